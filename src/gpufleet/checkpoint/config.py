"""Typed configuration and result records of the checkpoint engine (no torch import)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpufleet.core.errors import ConfigError

__all__ = ["CheckpointConfig", "LoadResult", "CheckpointInfo"]


@dataclass
class CheckpointConfig:
    """Where and how checkpoints are written.

    ``keep_last`` newest committed checkpoints are kept, plus (when ``keep_window_steps`` > 0) the
    newest one whose step is <= newest_step - keep_window_steps, so a loss-spike rollback always has
    a checkpoint from before the detection window. The newest verified checkpoint is never deleted.
    """

    dir: str
    upload_url: str | None = None
    s3_endpoint: str | None = None
    keep_last: int = 3
    keep_window_steps: int = 0
    io_threads: int = 4
    direct_io: bool = True  # O_DIRECT shard writes where the filesystem supports it
    memory_bytes: int = 0  # in-memory tier budget (storage/memory.py); 0: off
    memory_dir: str | None = None  # the tier's keeper directory (default: memtier.keeper_dir(dir))
    # Keep the newest commit's staged copy whole in this process (checkpoint/snapshot.py): a survivor
    # of an in-process restart rolls back from it. Costs the staging of the tensors DCP's
    # deduplication gives other ranks: their copy and memory (about (world_size-1)/world_size of a
    # replicated state more per rank). A save keeps one only while the node's ranks fit in half the
    # memory they could use (CheckpointEngine._snapshot_fits); else it warns once and stages as usual.
    keep_snapshot: bool = False
    # A reader only (a hot spare preloading commits): never removes a killed save's temp directories
    # nor owns the memory tier; only ``load`` is meant to be used.
    read_only: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.dir, str) or not self.dir.strip():
            raise ConfigError("checkpoint dir must be a non-empty path")
        if "://" in self.dir:
            raise ConfigError(f"checkpoint dir must be a filesystem path, got {self.dir!r} (use upload_url)")
        if self.upload_url is not None and not self.upload_url.startswith("s3://"):
            raise ConfigError(f"upload_url must start with s3://, got {self.upload_url!r}")
        if self.upload_url is not None and len(self.upload_url) <= len("s3://"):
            raise ConfigError("upload_url must name a bucket: s3://bucket/prefix")
        if isinstance(self.keep_last, bool) or not isinstance(self.keep_last, int) or self.keep_last < 1:
            raise ConfigError(f"keep_last must be an integer >= 1, got {self.keep_last!r}")
        if (
            isinstance(self.keep_window_steps, bool)
            or not isinstance(self.keep_window_steps, int)
            or self.keep_window_steps < 0
        ):
            raise ConfigError(f"keep_window_steps must be an integer >= 0, got {self.keep_window_steps!r}")
        if (
            isinstance(self.io_threads, bool)
            or not isinstance(self.io_threads, int)
            or not 1 <= self.io_threads <= 64
        ):
            raise ConfigError(f"io_threads must be an integer in 1..64, got {self.io_threads!r}")
        if not isinstance(self.direct_io, bool):
            raise ConfigError(f"direct_io must be true or false, got {self.direct_io!r}")
        mem = self.memory_bytes
        if isinstance(mem, bool) or not isinstance(mem, int) or mem < 0:
            raise ConfigError(f"memory_bytes must be an integer >= 0, got {self.memory_bytes!r}")


@dataclass
class LoadResult:
    """What :meth:`CheckpointEngine.load` restored."""

    step: int
    path: str
    source: str  # "memory" | "peer_memory" | "local" | "s3"
    meta: dict[str, Any]
    load_s: float
    state_dict: dict[str, Any] = field(repr=False)
    missing: list[str] = field(default_factory=list)  # optional entries the checkpoint lacked (load())


@dataclass
class CheckpointInfo:
    """One committed checkpoint (valid manifest; contents not re-verified)."""

    step: int
    path: str
    time: float
    bytes: int
    location: str  # "local" | "s3"

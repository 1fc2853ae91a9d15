"""Choosing the checkpoint to restore: newest first; memory, local disk, then S3; verified, with fallback.

Two ways to verify a candidate:
- one pass (single process): ``onepass.read_verified`` reads every file once, hashing as it reads,
  and keeps the bytes; the load then copies from memory (``reader.MemReader``);
- checksum pass (several ranks: rank 0 verifies for everyone, then every rank reads what it
  needs): ``verify.verify_dir`` hashes every file, then ``reader.FastReader`` reads again.
Either way nothing reaches the caller's tensors before every file of the chosen checkpoint matched
its manifest; a mismatch emits RESTORE_REJECTED with the reason and the next candidate is tried.

What restore needs from the engine is a :class:`RestoreContext` (the engine's ``restore_context()``):
restore never imports the engine nor touches its private state.
"""

from __future__ import annotations

import json
import os
import pickle
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import xxhash
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.tensor import DTensor

from gpufleet.checkpoint.config import CheckpointConfig
from gpufleet.checkpoint.failures import failure_reason
from gpufleet.checkpoint.manifest import Manifest, list_committed, step_dirname
from gpufleet.checkpoint.storage import s3
from gpufleet.checkpoint.storage.local.onepass import Loaded, ScratchPool, read_verified
from gpufleet.checkpoint.verify import verify_dir, xxh3_hex
from gpufleet.core import events as E
from gpufleet.core.errors import CheckpointError, StorageError

__all__ = [
    "RestoreContext",
    "agree_on_choice",
    "choose",
    "forget_choice",
    "newest_metadata",
    "receive_buffers",
]

_BUFFER_MIN = 1 << 20  # tensors at least this large are read straight into a staging buffer

Verifier = Callable[[Path], tuple[Manifest | None, str | None, Loaded | None]]


@dataclass(frozen=True)
class RestoreContext:
    """What a restore needs from its rank's checkpoint engine.

    ``emit(kind, **fields)``: ledger events (a no-op off rank 0); ``buffer_for(fqn, tensor)``: the
    staging buffer the next save of that tensor would use; ``pool``: scratch memory reused across
    loads; ``pg``: the process group of the checkpoint collectives (None: a single process)."""

    config: CheckpointConfig
    root: Path
    rank: int
    pg: Any
    emit: Callable[..., None]
    buffer_for: Callable[[str, torch.Tensor], torch.Tensor]
    pool: ScratchPool
    memory: Path | None = None  # this node's in-memory tier (storage/memory.py), tried before local disk


def receive_buffers(ctx: RestoreContext, state_dict: dict[str, Any]) -> dict[str, torch.Tensor]:
    """fqn -> the engine's staging buffer for each large tensor of ``state_dict`` (created now if
    missing: the next save would create exactly this buffer, so its page faults are paid once)."""
    flat, _ = flatten_state_dict(state_dict)
    out: dict[str, torch.Tensor] = {}
    for fqn, t in flat.items():
        if isinstance(t, DTensor):
            t = t.to_local()  # the engine stages a DTensor's local shard under the same key
        if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.nbytes >= _BUFFER_MIN:
            out[fqn] = ctx.buffer_for(fqn, t.detach())
    return out


def newest_metadata(ctx: RestoreContext, max_step: int | None) -> Any | None:
    """DCP ``Metadata`` of the newest committed checkpoint on local disk (step <= ``max_step``),
    its ``.metadata`` checked against the manifest first; None when there is none or it does not
    match. Only the shapes are used (to build the load's template without running the optimizer);
    the restore itself still verifies whatever checkpoint it chooses."""
    for path, m in list_committed(ctx.root):
        if max_step is not None and m.step > max_step:
            continue
        entry = m.files.get(".metadata")
        if entry is None:
            return None
        try:
            raw = (path / ".metadata").read_bytes()
            if (len(raw), xxh3_hex(xxhash.xxh3_64(raw))) != (entry.bytes, entry.xxh3):
                return None
            return pickle.loads(raw)  # verified bytes, written by our own commit
        except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError):
            return None
    return None


def has_candidates(ctx: RestoreContext, max_step: int | None) -> bool:
    """Whether any tier holds a committed checkpoint at or below ``max_step`` (unverified: only
    :func:`choose` says whether one restores). Local disk first; S3 is listed only without one."""

    def fits(step: int) -> bool:
        return max_step is None or step <= max_step

    if any(fits(m.step) for _, m in list_committed(ctx.root)):
        return True
    if ctx.memory is not None and any(fits(m.step) for _, m in list_committed(ctx.memory)):
        return True  # choose() only uses a memory copy that matches a disk commit; a cheap superset
    return bool(ctx.config.upload_url) and any(fits(s) for s in s3.list_steps(ctx.config))


def choose(
    ctx: RestoreContext, max_step: int | None, state_dict: dict[str, Any] | None
) -> tuple[int, str, str, dict[str, Any], Loaded | None] | None:
    """(step, path, source, meta, loaded) of the newest checkpoint that verifies, or None.
    ``state_dict`` given: one-pass verification (``loaded`` holds the bytes); else checksum pass."""
    cfg = ctx.config
    verify: Verifier
    if state_dict is not None:
        buffers = receive_buffers(ctx, state_dict)

        def verify(p: Path) -> tuple[Manifest | None, str | None, Loaded | None]:
            return read_verified(p, buffers, ctx.pool, threads=cfg.io_threads, direct=cfg.direct_io)
    else:

        def verify(p: Path) -> tuple[Manifest | None, str | None, Loaded | None]:
            m, reason = verify_dir(p, cfg.io_threads)
            return m, reason, None

    on_disk = {m.step: (p, m) for p, m in list_committed(ctx.root)}
    local = {step: p for step, (p, _) in on_disk.items()}
    # A memory copy stands for a disk commit with the same checksums; steps moved away or deleted
    # on disk (an abandoned trajectory, a run directory started over) are never restored from memory.
    memory = {
        m.step: p
        for p, m in (list_committed(ctx.memory) if ctx.memory is not None else [])
        if m.step in on_disk and on_disk[m.step][1].files == m.files
    }
    remote_steps = s3.list_steps(cfg) if cfg.upload_url else {}
    for step in sorted(set(local) | set(remote_steps) | set(memory), reverse=True):
        if max_step is not None and step > max_step:
            continue
        candidates: list[tuple[str, Callable[[], Path]]] = []
        if step in memory:  # the same manifest and checksums as on disk: verified the same way
            candidates.append(("memory", lambda p=memory[step]: p))
        if step in local:
            candidates.append(("local", lambda p=local[step]: p))
        if step in remote_steps:
            candidates.append(("s3", lambda s=step: s3.download_commit(cfg, remote_steps[s], ctx.root)))
        for source, get in candidates:
            t0 = time.perf_counter()
            try:
                path = get()
            except (StorageError, OSError) as e:  # this copy is unusable: try the next candidate
                ctx.emit(
                    E.RestoreRejected(
                        path=s3.url_for(cfg, step_dirname(step)),
                        step=step,
                        reason=f"download failed: {failure_reason(e)}",
                    )
                )
                continue
            m, reason, loaded = verify(path)
            if reason is None and m is not None:
                extra: dict[str, Any] = {}
                if loaded is not None:
                    extra = {
                        "one_pass": True,
                        "cached_files": loaded.cached_files,
                        "direct_files": loaded.direct_files,
                        "in_buffers_bytes": loaded.in_buffers,
                    }
                ctx.emit(
                    E.CkptVerified(
                        step=step,
                        path=str(path),
                        verify_s=round(time.perf_counter() - t0, 6),
                        source=E.RestoreSource(source),
                        **extra,
                    )
                )
                return step, str(path), source, m.meta, loaded
            ctx.emit(E.RestoreRejected(path=str(path), step=step, reason=reason))
    return None


Choice = tuple[int, str, str, dict[str, Any]] | None


def agree_on_choice(
    ctx: RestoreContext, decide: Callable[[], Choice], *, timeout_s: float = 3600.0
) -> Choice:
    """Rank 0 decides (verifying, and downloading from S3 when it must); the other ranks read its
    decision from a file in the shared checkpoint directory instead of waiting inside a collective,
    so a slow or throttled S3 never sits under a process-group timeout. Only a token is broadcast,
    before anything slow starts."""
    token: list[str | None] = [uuid.uuid4().hex if ctx.rank == 0 else None]
    dist.broadcast_object_list(token, src=0, group=ctx.pg)
    path = ctx.root / ".restore" / f"{token[0]}.json"
    if ctx.rank == 0:
        choice = decide()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(list(choice) if choice is not None else None))
        os.replace(tmp, path)
        return choice
    start = time.monotonic()
    while not path.exists():
        waited = time.monotonic() - start
        if waited > timeout_s:
            raise CheckpointError(f"rank 0 did not choose a checkpoint to restore within {timeout_s:.0f} s")
        # A restart waits on this file (rank 0 verifies in a fraction of a second from page cache):
        # look often at first, then back off for a long verify or an S3 download.
        time.sleep(0.002 if waited < 1.0 else 0.05)
    raw = json.loads(path.read_text())
    return None if raw is None else (int(raw[0]), str(raw[1]), str(raw[2]), dict(raw[3]))


def forget_choice(ctx: RestoreContext) -> None:
    """Rank 0 removes restore hand-off files once every rank has loaded (after the load collective)."""
    if ctx.rank == 0:
        for p in (ctx.root / ".restore").glob("*.json"):
            p.unlink(missing_ok=True)

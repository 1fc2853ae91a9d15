"""The in-memory checkpoint tier (``gpufleet run --memory-tier SIZE``): a node's keeper (no torch).

Workers die with a failure; their memory with them. So the tier lives where workers do not: a
directory on the node's tmpfs (``/dev/shm``, host memory) owned by the run, one per checkpoint
directory, that outlives every worker process and is removed when ``gpufleet run`` exits.

The keeper holds committed checkpoints in exactly the on-disk layout (``step_N/`` with DCP's files
and ``manifest.json``), so restore verifies a memory copy with the very code and checksums it uses
for disk (``verify.verify_dir``, ``onepass.read_verified``), and a copy that fails is rejected like
any other. The copy itself follows the disk commit protocol: files into ``step_N.tmp``, each
hashed while copied and compared with the manifest, rename, manifest last; eviction removes the
manifest first. A kill at any point leaves either a complete copy or one restore cannot see.

Budget: the bytes of every checkpoint held (files + manifest) stay within ``budget_bytes``. Room for
a new checkpoint is made by evicting the oldest steps; one larger than the whole budget is not kept
(the ``ckpt_memory`` event says so) and training goes on.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from gpufleet.checkpoint.manifest import (
    MANIFEST_NAME,
    Manifest,
    list_committed,
    parse_step,
    step_dirname,
    write_manifest,
)
from gpufleet.checkpoint.verify import xxh3_hex
from gpufleet.core.env import Env, read_env
from gpufleet.core.errors import ConfigError
from gpufleet.core.launch import node_name

__all__ = [
    "KeepResult",
    "MemoryKeeper",
    "keeper_dir",
    "manifest_bytes",
    "release",
]

_CHUNK = 8 << 20


def keeper_dir(ckpt_dir: str | os.PathLike[str], root: str | os.PathLike[str] | None = None) -> Path:
    """This node's keeper directory for a checkpoint directory: the same one for every attempt of a
    run (the restarted workers find it), another for another checkpoint directory.

    ``%n`` in the root (``GPUFLEET_MEMORY_TIER_DIR``) is this node's name
    (:func:`gpufleet.core.launch.node_name`): several nodes that share one host's ``/dev/shm`` (the
    CI's one-host Slurm cluster) each get their own."""
    raw = str(root if root is not None else read_env(Env.MEMORY_TIER_DIR, str, "/dev/shm"))
    base = Path(raw.replace("%n", node_name()))
    key = hashlib.sha1(os.path.realpath(ckpt_dir).encode()).hexdigest()[:16]
    return base / f"gpufleet-memtier-{os.getuid()}" / key


def release(ckpt_dir: str | os.PathLike[str]) -> None:
    """Free this node's in-memory copies for a checkpoint directory (the run is over)."""
    d = keeper_dir(ckpt_dir)
    shutil.rmtree(d, ignore_errors=True)
    try:
        d.parent.rmdir()  # the user's directory of keepers, once no other run has one
    except OSError:
        pass


@dataclass(kw_only=True, slots=True)
class KeepResult:
    """What :meth:`MemoryKeeper.keep` did with one committed checkpoint."""

    step: int
    """The checkpoint's step."""
    kept: bool
    """A verified copy is now held in memory."""
    bytes: int
    """The checkpoint's size: its files plus its manifest."""
    used_bytes: int
    """Bytes the keeper holds afterwards."""
    budget_bytes: int
    """The budget it holds them within."""
    evicted: list[int] = field(default_factory=list)
    """Older steps dropped to make room."""
    copy_s: float | None = None
    """Copy + verify seconds (kept only)."""
    reason: str | None = None
    """Why it was not kept."""


def manifest_bytes(manifest: Manifest) -> int:
    # write_manifest's own encoding: what the copy's manifest.json will weigh
    return len((json.dumps(manifest.to_json(), indent=1, default=str) + "\n").encode())


def _copy_hashed(src: Path, dst: Path, buf: bytearray) -> tuple[int, str]:
    """Copy ``src`` to ``dst``, hashing the bytes as they pass: (size, xxh3_64 hex) of what was written."""
    h = xxhash.xxh3_64()
    n = 0
    view = memoryview(buf)
    with open(src, "rb", buffering=0) as fi, open(dst, "wb", buffering=0) as fo:
        while True:
            k = fi.readinto(buf)
            if not k:
                break
            h.update(view[:k])
            out = view[:k]
            while out:
                out = out[fo.write(out) :]
            n += k
    return n, xxh3_hex(h)


class MemoryKeeper:
    """One node's in-memory checkpoints under ``root`` (a tmpfs directory), within ``budget_bytes``."""

    def __init__(self, root: str | os.PathLike[str], budget_bytes: int) -> None:
        if budget_bytes <= 0:
            raise ConfigError(f"memory tier budget must be > 0 bytes, got {budget_bytes}")
        self.root = Path(root)
        self.budget_bytes = budget_bytes

    def committed(self) -> list[tuple[Path, Manifest]]:
        """Copies restore can see (valid manifest), newest step first."""
        return list_committed(self.root)

    def steps(self) -> list[int]:
        return [m.step for _, m in self.committed()]

    def used_bytes(self) -> int:
        """Bytes of every file under the keeper, torn copies included: what the memory holds."""
        total = 0
        if self.root.is_dir():
            for dirpath, _, names in os.walk(self.root):
                for name in names:
                    try:
                        total += os.lstat(os.path.join(dirpath, name)).st_size
                    except OSError:
                        continue
        return total

    def _drop(self, path: Path) -> None:
        (path / MANIFEST_NAME).unlink(missing_ok=True)  # invisible first, then gone
        shutil.rmtree(path, ignore_errors=True)

    def sweep(self) -> None:
        """Remove what a killed copy left: temp dirs and step dirs without a valid manifest."""
        if not self.root.is_dir():
            return
        valid = {p.name for p, _ in self.committed()}
        for p in self.root.iterdir():
            if (
                p.is_dir()
                and p.name not in valid
                and (p.name.endswith(".tmp") or parse_step(p.name) is not None)
            ):
                shutil.rmtree(p, ignore_errors=True)

    def evict(self, step: int) -> bool:
        """Drop the copy of ``step``; False if there was none."""
        for p, m in self.committed():
            if m.step == step:
                self._drop(p)
                return True
        return False

    def keep(self, src: str | os.PathLike[str], manifest: Manifest) -> KeepResult:
        """Copy the committed checkpoint ``src`` (whose manifest is ``manifest``) into memory,
        verifying every file against the manifest while copying; evict the oldest copies for room."""
        src = Path(src)
        need = manifest.total_bytes + manifest_bytes(manifest)

        def result(kept: bool, **kw: object) -> KeepResult:
            return KeepResult(
                step=manifest.step,
                kept=kept,
                bytes=need,
                used_bytes=self.used_bytes(),
                budget_bytes=self.budget_bytes,
                **kw,  # type: ignore[arg-type]
            )

        if need > self.budget_bytes:
            return result(
                False,
                reason=f"checkpoint of {need} bytes is larger than the memory tier budget "
                f"({self.budget_bytes} bytes); disk and S3 still hold it",
            )
        self.root.mkdir(parents=True, exist_ok=True)
        self.sweep()
        self.evict(manifest.step)  # a step saved again (after a rollback): the new one replaces it
        evicted: list[int] = []
        for path, m in sorted(self.committed(), key=lambda pm: pm[1].step):  # oldest first
            if self.used_bytes() + need <= self.budget_bytes:
                break
            self._drop(path)
            evicted.append(m.step)
        t0 = time.perf_counter()
        tmp = self.root / (step_dirname(manifest.step) + ".tmp")
        final = self.root / step_dirname(manifest.step)
        try:
            tmp.mkdir()
            buf = bytearray(_CHUNK)
            for name, entry in sorted(manifest.files.items()):
                size, digest = _copy_hashed(src / name, tmp / name, buf)
                if size != entry.bytes or digest != entry.xxh3:
                    raise _Mismatch(
                        f"copy of {name} does not match the manifest "
                        f"({size} bytes, xxh3 {digest}; manifest: {entry.bytes} bytes, xxh3 {entry.xxh3})"
                    )
            os.rename(tmp, final)
            write_manifest(final, manifest)  # the commit point, as on disk
        except (OSError, _Mismatch) as e:
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(final, ignore_errors=True)
            why = str(e) if isinstance(e, _Mismatch) else f"copy failed: {e.strerror or e}"
            return result(False, evicted=evicted, reason=why)
        return result(True, evicted=evicted, copy_s=round(time.perf_counter() - t0, 6))


class _Mismatch(Exception):
    pass

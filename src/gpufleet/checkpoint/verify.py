"""Verify a checkpoint directory against its manifest: every file's size and xxh3_64 (no torch).

Also resolves what a user points ``gpufleet ckpt`` at: one checkpoint, a checkpoints directory or a
run directory.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import xxhash

from gpufleet.checkpoint.manifest import MANIFEST_NAME, Manifest, parse_step, read_manifest
from gpufleet.core.errors import UsageError

__all__ = ["CheckpointTarget", "hash_file", "resolve_target", "verify_dir", "xxh3_hex"]

_CHUNK = 8 << 20


def xxh3_hex(h: xxhash.xxh3_64) -> str:
    return f"{h.intdigest():016x}"


def hash_file(path: str | os.PathLike[str]) -> tuple[int, str]:
    """(size, xxh3_64 hex) of a file, read in large chunks (xxhash releases the GIL)."""
    h = xxhash.xxh3_64()
    n = 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            k = f.readinto(buf)
            if not k:
                break
            h.update(view[:k])
            n += k
    return n, xxh3_hex(h)


def _check(d: Path, name: str, size: int, digest: str) -> str | None:
    p = d / name
    try:
        actual = p.stat().st_size
    except FileNotFoundError:
        return f"missing file {name}"
    except OSError as e:
        return f"cannot stat {name}: {e.strerror or e}"
    if actual != size:
        return f"size mismatch in {name}: {actual} bytes, manifest says {size}"
    try:
        got_size, got = hash_file(p)
    except OSError as e:
        return f"cannot read {name}: {e.strerror or e}"
    if got_size != size:
        return f"size mismatch in {name}: read {got_size} bytes, manifest says {size}"
    if got != digest:
        return f"checksum mismatch in {name}: xxh3 {got}, manifest says {digest}"
    return None


def verify_dir(ckpt_dir: str | os.PathLike[str], threads: int = 4) -> tuple[Manifest | None, str | None]:
    """(manifest, None) when every file matches; (manifest or None, reason) on the first problem."""
    d = Path(ckpt_dir)
    try:
        m = read_manifest(d)
    except FileNotFoundError:
        return None, "no manifest"
    except (OSError, ValueError) as e:
        return None, f"invalid manifest: {e}"
    if ".metadata" not in m.files:
        return m, "manifest does not list DCP .metadata"
    items = sorted(m.files.items())
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(items)))) as pool:
        for reason in pool.map(lambda kv: _check(d, kv[0], kv[1].bytes, kv[1].xxh3), items):
            if reason is not None:
                return m, reason
    return m, None


@dataclass(frozen=True)
class CheckpointTarget:
    """What a path given to ``gpufleet ckpt`` names, and the checkpoint directories in it (newest first)."""

    kind: Literal["checkpoint", "checkpoints", "run"]
    root: Path  # the checkpoints directory (the parent of a single checkpoint)
    dirs: list[Path]


def _is_checkpoint(p: Path) -> bool:
    """A single checkpoint: a ``step_N`` directory or one holding a manifest or DCP's ``.metadata``."""
    return parse_step(p.name) is not None or (p / MANIFEST_NAME).is_file() or (p / ".metadata").is_file()


def _step_dirs(root: Path) -> list[Path]:
    found = [p for p in root.iterdir() if p.is_dir() and parse_step(p.name) is not None]
    return sorted(found, key=lambda p: parse_step(p.name) or 0, reverse=True)


def resolve_target(path: str | os.PathLike[str]) -> CheckpointTarget:
    """Resolve a checkpoint, a checkpoints directory (``step_*`` inside) or a run directory.

    Raises UsageError for a path that is none of these, or that holds no checkpoint directory: an
    empty answer must never pass for a verified one.
    """
    p = Path(path)
    if not p.exists():
        raise UsageError(f"no such directory: {path}")
    if not p.is_dir():
        raise UsageError(f"not a directory: {path}")
    if _is_checkpoint(p):
        return CheckpointTarget("checkpoint", p.parent, [p])
    dirs = _step_dirs(p)
    if dirs:
        return CheckpointTarget("checkpoints", p, dirs)
    sub = p / "checkpoints"
    if sub.is_dir():
        dirs = _step_dirs(sub)
        if dirs:
            return CheckpointTarget("run", sub, dirs)
        raise UsageError(f"no checkpoint directories in {sub} (run directory {path})")
    raise UsageError(
        f"{path} is not a checkpoint, a checkpoints directory or a run directory "
        "(no manifest.json, no step_* directories, no checkpoints/)"
    )

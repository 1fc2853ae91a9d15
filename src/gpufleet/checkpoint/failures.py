"""Turning persist failures into one-line reasons, and the corrupt-after-commit drill."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from gpufleet.checkpoint.manifest import FileEntry

__all__ = ["failure_reason", "flip_byte"]


def failure_reason(e: BaseException) -> str:
    """One line saying why a persist failed; disk-full is named as such."""
    seen: list[BaseException] = [e]
    failures = getattr(e, "failures", None)  # DCP's CheckpointException: {rank: exc or (exc, tb)}
    if isinstance(failures, dict):
        for v in failures.values():
            seen.append(v[0] if isinstance(v, tuple) else v)
    for x in list(seen):
        while x.__cause__ is not None or x.__context__ is not None:
            x = x.__cause__ or x.__context__  # type: ignore[assignment]
            seen.append(x)
    for x in seen:
        if isinstance(x, OSError) and x.errno == errno.ENOSPC:
            return f"disk full (ENOSPC) while writing the checkpoint: {x.strerror}"
    for x in seen[1:] + seen[:1]:
        if isinstance(x, BaseException) and not hasattr(x, "failures"):
            return f"{type(x).__name__}: {x}".splitlines()[0][:300]
    return str(e).splitlines()[0][:300]


def flip_byte(final: Path, files: dict[str, FileEntry]) -> None:
    """fault=corrupt: flip one byte in the middle of the largest shard, after the commit."""
    name = max((n for n in files if n.endswith(".distcp")), key=lambda n: files[n].bytes, default=None)
    if name is None or files[name].bytes == 0:
        return
    with open(final / name, "r+b") as f:
        f.seek(files[name].bytes // 2)
        b = f.read(1)
        f.seek(files[name].bytes // 2)
        f.write(bytes([b[0] ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())

"""Verify a checkpoint directory against its manifest: every file's size and xxh3_64 (no torch)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import xxhash

from gpufleet.checkpoint.manifest import Manifest, read_manifest

__all__ = ["hash_file", "verify_dir", "xxh3_hex"]

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

"""One-pass verified restore: read every file of a checkpoint once, hashing as it arrives.

Each shard file is read sequentially, exactly once, into page-aligned memory, and its xxh3_64 is
computed chunk by chunk while the next chunks are read (files in parallel). Nothing reaches the
caller here: :func:`read_verified` returns the bytes only when *every* file's size and checksum
match the manifest; the caller then copies tensors out of it (``reader.MemReader``).

Where the bytes land:
- the raw data of a large tensor (page-aligned in the file: see ``writer``) whose fqn has an engine
  staging buffer of the same size goes straight into that buffer. If the engine has no buffer yet
  (a fresh process after a restart), it is created now from the caller's tensor, exactly as the next
  ``save`` would create it, so the page faults of that memory are paid once, not once per restore
  and once more by the first save;
- everything else (headers, small items, tensors without a buffer) goes into a reusable pool of
  page-aligned chunks owned by the engine.
Files whose pages are already in the page cache (e.g. just written buffered) are read buffered,
at memory speed; others with O_DIRECT where the filesystem allows it. Where each piece lands is a
performance choice only: the hash covers every byte in file order, whatever the segmentation.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import pickle
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from gpufleet.checkpoint.manifest import Manifest, read_manifest
from gpufleet.checkpoint.storage.local.writer import ALIGN, address
from gpufleet.checkpoint.verify import xxh3_hex

__all__ = ["Loaded", "ScratchPool", "read_verified"]

_POOL_CHUNK = 16 << 20  # scratch chunk size (page-aligned anonymous mappings, reused)
_READ = 16 << 20  # read (and hash) granularity
_LOCAL_HEADER = b"PK\x03\x04"


class ScratchPool:
    """Reusable page-aligned chunks for the bytes that have no staging buffer."""

    def __init__(self) -> None:
        self._free: list[mmap.mmap] = []
        self.allocated = 0  # chunks ever created (a test/benchmark figure)

    def take(self) -> mmap.mmap:
        if self._free:
            return self._free.pop()
        mm = mmap.mmap(-1, _POOL_CHUNK)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                mm.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass
        self.allocated += 1
        return mm

    def give(self, chunks: list[mmap.mmap]) -> None:
        self._free.extend(chunks)


@dataclass
class _File:
    """A file's bytes as (file offset, memory) pieces in file order, covering [0, size)."""

    size: int
    segs: list[tuple[int, memoryview]] = field(default_factory=list)
    in_buffers: int = 0  # bytes read straight into staging buffers
    chunks: list[mmap.mmap] = field(default_factory=list)


@dataclass
class Loaded:
    """A verified checkpoint in memory: the DCP metadata and every shard file's bytes."""

    metadata: Any
    files: dict[str, _File]
    pool: ScratchPool
    read_s: float = 0.0
    cached_files: int = 0
    direct_files: int = 0

    @property
    def in_buffers(self) -> int:
        return sum(f.in_buffers for f in self.files.values())

    def release(self) -> None:
        for f in self.files.values():
            f.segs.clear()
            self.pool.give(f.chunks)
            f.chunks = []
        self.files = {}


# --------------------------------------------------------------------------- page-cache residency
_libc: Any = None


def _cached_fraction(fd: int, size: int) -> float:
    """Fraction of the file's pages in the page cache (mincore on a mapping); 0.0 if unknown."""
    global _libc
    if size == 0:
        return 1.0
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    except (OSError, AttributeError, ValueError):
        return 0.0
    try:
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = np.zeros(pages, dtype=np.uint8)
        base = np.frombuffer(mm, dtype=np.uint8)
        rc = _libc.mincore(ctypes.c_void_p(base.ctypes.data), size, ctypes.c_void_p(vec.ctypes.data))
        del base
        return float((vec & 1).mean()) if rc == 0 else 0.0
    finally:
        mm.close()


# --------------------------------------------------------------------------- reading one file
class _FileReader:
    def __init__(self, path: Path, size: int, direct: bool, pool: ScratchPool) -> None:
        self.size = size
        self.pool = pool
        self.out = _File(size)
        self.h = xxhash.xxh3_64()
        self.hashed = 0  # bytes hashed == bytes placed (file order)
        self.fd = os.open(path, os.O_RDONLY)
        self.cached = _cached_fraction(self.fd, size) >= 0.9
        self.dfd = -1
        if direct and not self.cached and hasattr(os, "O_DIRECT"):
            try:
                self.dfd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError as e:
                if e.errno != errno.EINVAL:  # EINVAL: no O_DIRECT on this filesystem (tmpfs, ...)
                    raise
        self._chunk: memoryview | None = None
        self._used = 0

    def close(self) -> None:
        os.close(self.fd)
        if self.dfd >= 0:
            os.close(self.dfd)

    def _pread(self, view: memoryview, offset: int) -> None:
        """Fill ``view`` from ``offset`` (it may end past EOF when the file ends inside it)."""
        want = min(view.nbytes, self.size - offset)
        got = 0
        while got < want:
            aligned = (offset + got) % ALIGN == 0 and address(view[got:]) % ALIGN == 0
            if self.dfd >= 0 and aligned:
                n = os.preadv(self.dfd, [view[got : got + _round_up(want - got)]], offset + got)
            else:
                n = os.preadv(self.fd, [view[got:want]], offset + got)
            if n <= 0:
                raise OSError(errno.EIO, f"unexpected end of file at {offset + got} of {self.size}")
            got += n

    def _take(self, n: int) -> memoryview:
        """``n`` bytes (capacity rounded up to a page) of aligned scratch."""
        cap = _round_up(n)
        if self._chunk is None or self._used + cap > _POOL_CHUNK:
            mm = self.pool.take()
            self.out.chunks.append(mm)
            self._chunk, self._used = memoryview(mm), 0
        view = self._chunk[self._used : self._used + cap]
        self._used += cap
        return view

    def scratch(self, end: int) -> None:
        """Read [hashed, end) into scratch, hashing as it arrives. ``end`` is page-aligned or EOF,
        so every read starts page-aligned (O_DIRECT needs it)."""
        while self.hashed < end:
            n = min(end - self.hashed, _READ, _POOL_CHUNK)
            view = self._take(n)
            self._place(view, n)

    def into(self, dest: memoryview) -> None:
        """Read the next ``dest.nbytes`` bytes straight into ``dest`` (a staging buffer)."""
        self.out.in_buffers += dest.nbytes
        for i in range(0, dest.nbytes, _READ):
            part = dest[i : i + _READ]
            self._place(part, part.nbytes)

    def _place(self, view: memoryview, n: int) -> None:
        off = self.hashed
        self._pread(view, off)
        part = view[:n]
        self.h.update(part)
        self.out.segs.append((off, part))
        self.hashed += n

    def peek_data_start(self, rec_off: int, rec_end: int) -> int | None:
        """Scratch-read the item's head page by page until its tensor-data local header ends; that
        end is where the raw data starts (when it is page-aligned). None when not found."""
        limit = min(rec_end, rec_off + 64 * 1024)
        while self.hashed < limit:
            self.scratch(min(self.size, self.hashed - self.hashed % ALIGN + ALIGN))
            head = _joined(self.out.segs, rec_off, self.hashed)
            pos = head.find(_LOCAL_HEADER)
            while pos >= 0 and pos + 30 <= len(head):
                name_len, extra_len = struct.unpack("<HH", head[pos + 26 : pos + 30])
                end = pos + 30 + name_len + extra_len
                if end > len(head):
                    break  # this header continues on the next page
                name = head[pos + 30 : pos + 30 + name_len]
                if name.rsplit(b"/", 2)[-2:-1] == [b"data"]:
                    start = rec_off + end
                    return start if start % ALIGN == 0 and start >= self.hashed else None
                pos = head.find(_LOCAL_HEADER, end)
        return None


def _joined(segs: list[tuple[int, memoryview]], start: int, end: int) -> bytes:
    out = []
    for off, view in segs:
        lo, hi = max(start, off), min(end, off + view.nbytes)
        if lo < hi:
            out.append(bytes(view[lo - off : hi - off]))
    return b"".join(out)


def _round_up(n: int) -> int:
    return n + (-n % ALIGN)


def _read_file(
    path: Path, size: int, items: list[tuple[int, int, torch.Tensor | None]], direct: bool, pool: ScratchPool
) -> tuple[_File, str, bool, bool]:
    """Read one file in order. ``items``: (record offset, record length, staging buffer or None),
    sorted by offset. Returns the pieces, the xxh3 hex, whether it was cached, whether O_DIRECT."""
    r = _FileReader(path, size, direct, pool)
    try:
        for off, length, buf in items:
            if buf is None:
                continue
            r.scratch(max(r.hashed, off - off % ALIGN))
            start = r.peek_data_start(off, off + length)
            view = memoryview(buf.reshape(-1).view(torch.uint8).numpy())
            n = view.nbytes - view.nbytes % ALIGN
            if start is None or address(view) % ALIGN or start + view.nbytes > off + length or n == 0:
                continue  # not the expected layout: these bytes just go to scratch
            r.scratch(start)
            r.into(view[:n])
        r.scratch(size)
        return r.out, xxh3_hex(r.h), r.cached, r.dfd >= 0
    except BaseException:
        pool.give(r.out.chunks)
        raise
    finally:
        r.close()


def read_verified(
    ckpt_dir: str | os.PathLike[str],
    buffers: dict[str, torch.Tensor],
    pool: ScratchPool,
    *,
    threads: int = 4,
    direct: bool = True,
) -> tuple[Manifest | None, str | None, Loaded | None]:
    """(manifest, None, loaded) when every file matches the manifest; (manifest|None, reason, None)
    otherwise. ``buffers``: fqn -> page-aligned tensor to receive that item's data when sizes fit."""
    d = Path(ckpt_dir)
    try:
        m = read_manifest(d)
    except FileNotFoundError:
        return None, "no manifest", None
    except (OSError, ValueError) as e:
        return None, f"invalid manifest: {e}", None
    if ".metadata" not in m.files:
        return m, "manifest does not list DCP .metadata", None
    for name, entry in sorted(m.files.items()):  # cheap checks first: a missing or short file
        try:
            actual = (d / name).stat().st_size
        except FileNotFoundError:
            return m, f"missing file {name}", None
        except OSError as e:
            return m, f"cannot stat {name}: {e.strerror or e}", None
        if actual != entry.bytes:
            return m, f"size mismatch in {name}: {actual} bytes, manifest says {entry.bytes}", None
    meta_entry = m.files[".metadata"]
    try:
        raw = (d / ".metadata").read_bytes()
    except OSError as e:
        return m, f"cannot read .metadata: {e.strerror or e}", None
    got = xxh3_hex(xxhash.xxh3_64(raw))
    if len(raw) != meta_entry.bytes or got != meta_entry.xxh3:
        return m, f"checksum mismatch in .metadata: xxh3 {got}, manifest says {meta_entry.xxh3}", None
    metadata = pickle.loads(raw)  # verified bytes, written by our own commit

    plan: dict[str, list[tuple[int, int, torch.Tensor | None]]] = {n: [] for n in m.files if n != ".metadata"}
    for idx, info in (metadata.storage_data or {}).items():
        md = metadata.state_dict_metadata.get(idx.fqn)
        buf = buffers.get(idx.fqn)
        whole = (
            buf is not None
            and hasattr(md, "chunks")
            and len(md.chunks) == 1
            and not any(md.chunks[0].offsets)
            and list(md.chunks[0].sizes) == list(buf.shape)
            and md.properties.dtype == buf.dtype
        )
        if info.relative_path in plan:
            plan[info.relative_path].append((info.offset, info.length, buf if whole else None))
    for items in plan.values():
        items.sort(key=lambda x: x[0])

    files: dict[str, _File] = {}
    loaded = Loaded(metadata, files, pool)

    def one(name: str) -> str | None:
        entry = m.files[name]
        try:
            out, digest, cached, used_direct = _read_file(d / name, entry.bytes, plan[name], direct, pool)
        except OSError as e:
            return f"cannot read {name}: {e.strerror or e}"
        files[name] = out
        loaded.cached_files += cached
        loaded.direct_files += used_direct
        if digest != entry.xxh3:
            return f"checksum mismatch in {name}: xxh3 {digest}, manifest says {entry.xxh3}"
        return None

    names = sorted(plan, key=lambda n: -m.files[n].bytes)
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(names)))) as pool_ex:
        reasons = list(pool_ex.map(one, names))
    bad = next((r for r in reasons if r is not None), None)
    if bad is not None:
        loaded.release()
        return m, bad, None
    return m, None, loaded

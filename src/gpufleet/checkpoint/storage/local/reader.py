"""A DCP StorageReader that reads tensors straight into their destination, files in parallel.

DCP's FileSystemReader runs torch.load per item, which allocates a new tensor (page faults) and
copies it into the destination. When an item is a whole, contiguous, same-dtype tensor stored
uncompressed (always the case for gpufleet's writer), this reader finds the raw bytes inside the
item's torch.save zip record and ``readinto``s them directly into the destination tensor's memory:
one copy, no allocation. Anything else takes DCP's torch.load path. Items are read in offset order
(sequential per file), several files at once. The on-disk format is untouched: it is DCP's.
"""

from __future__ import annotations

import bisect
import io
import os
import struct
import warnings
import zipfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

__all__ = ["FastReader", "MemReader"]


def _read_exact(f: Any, offset: int, length: int) -> bytearray:
    buf = bytearray(length)
    view = memoryview(buf)
    f.seek(offset)
    got = 0
    while got < length:
        k = f.readinto(view[got:])
        if not k:
            raise OSError(f"unexpected end of file reading {length} bytes at {offset}")
        got += k
    return buf


def _read_into(f: Any, offset: int, target: torch.Tensor) -> None:
    view = memoryview(target.reshape(-1).view(torch.uint8).numpy()) if target.nbytes else memoryview(b"")
    f.seek(offset)
    got = 0
    while got < len(view):
        k = f.readinto(view[got:])
        if not k:
            raise OSError(f"unexpected end of file reading {len(view)} bytes at {offset}")
        got += k


class _Slice(io.RawIOBase):
    """A read-only window [offset, offset+length) of an open file, for zipfile."""

    def __init__(self, f: Any, offset: int, length: int) -> None:
        self._f, self._off, self._len, self._pos = f, offset, length, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._len}[whence]
        self._pos = max(0, min(self._len, base + pos))
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, b: Any) -> int:
        n = min(len(b), self._len - self._pos)
        if n <= 0:
            return 0
        self._f.seek(self._off + self._pos)
        k = self._f.readinto(memoryview(b)[:n])
        self._pos += k or 0
        return k or 0


def _raw_data_span(f: Any, offset: int, length: int) -> tuple[int, int] | None:
    """(absolute offset, size) of the single stored storage record of a torch.save'd item, or None."""
    try:
        zf = zipfile.ZipFile(_Slice(f, offset, length))
    except zipfile.BadZipFile:
        return None
    data = [i for i in zf.infolist() if i.filename.split("/")[-2:-1] == ["data"]]
    if len(data) != 1 or data[0].compress_type != zipfile.ZIP_STORED:
        return None
    info = data[0]
    f.seek(offset + info.header_offset)
    head = f.read(30)
    if len(head) != 30 or head[:4] != b"PK\x03\x04":
        return None
    name_len, extra_len = struct.unpack("<HH", head[26:30])
    return offset + info.header_offset + 30 + name_len + extra_len, info.file_size


def _load_item(req: Any, planner: LoadPlanner, data: bytes | bytearray) -> None:
    """Hand one read item's serialized bytes to the planner: BYTE_IO as a stream; a tensor is
    ``torch.load``-ed, narrowed to the request's slice and copied into the planner's target."""
    if req.type == LoadItemType.BYTE_IO:
        planner.load_bytes(req, io.BytesIO(data))
        return
    tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    del data
    tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
    target = planner.resolve_tensor(req).detach()
    if target.size() != tensor.size():
        raise ValueError(
            f"{req.storage_index.fqn}: size {tuple(tensor.size())} in checkpoint, "
            f"{tuple(target.size())} in the state dict"
        )
    target.copy_(tensor)
    planner.commit_tensor(req, target)


class FastReader(FileSystemReader):
    """FileSystemReader with large sequential reads and one thread per file (up to ``threads``)."""

    def __init__(self, path: str | os.PathLike[str], threads: int = 4) -> None:
        super().__init__(path)
        self.threads = threads
        self._meta: Any = None

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._meta = metadata

    def _direct_target(self, req: Any, planner: LoadPlanner) -> torch.Tensor | None:
        """The destination tensor when the item can be read straight into it, else None."""
        md = self._meta.state_dict_metadata.get(req.storage_index.fqn) if self._meta else None
        props = getattr(md, "properties", None)
        if props is None or any(req.storage_offsets) or any(req.dest_offsets):
            return None
        chunks = [c for c in md.chunks if list(c.offsets) == list(req.storage_index.offset or c.offsets)]
        if len(chunks) != 1 or list(chunks[0].sizes) != list(req.lengths):
            return None  # reading part of a saved chunk (resharding): DCP's path
        target = planner.resolve_tensor(req).detach()
        if target.dtype != props.dtype or list(target.shape) != list(req.lengths):
            return None
        if not target.is_contiguous():
            return None
        # A GPU target too: its bytes are copied from host memory (pinned when the engine's staging
        # buffer received them). torch.load of the serialized record, the other path, copies every
        # byte three times through Python bytes: 0.3 GB/s into an H200.
        return target

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[Any]] = {}
        for req in plan.items:
            md = self.storage_data[req.storage_index]
            if md.transform_descriptors:
                return super().read_data(plan, planner)  # stream transforms: DCP's own path
            per_file.setdefault(md.relative_path, []).append(req)

        def one_file(rel: str, reqs: list[Any]) -> None:
            reqs.sort(key=lambda r: self.storage_data[r.storage_index].offset)
            with open(Path(self.path) / rel, "rb", buffering=0) as f:
                for req in reqs:
                    md = self.storage_data[req.storage_index]
                    if req.type != LoadItemType.BYTE_IO:
                        target = self._direct_target(req, planner)
                        span = _raw_data_span(f, md.offset, md.length) if target is not None else None
                        if target is not None and span is not None and span[1] == target.nbytes:
                            if target.device.type == "cpu":
                                _read_into(f, span[0], target)
                            else:  # a GPU tensor: through one host buffer, not torch.load's copies
                                host = torch.empty(target.nbytes, dtype=torch.uint8)
                                _read_into(f, span[0], host)
                                target.reshape(-1).view(torch.uint8).copy_(host)
                            planner.commit_tensor(req, target)
                            continue
                    _load_item(req, planner, _read_exact(f, md.offset, md.length))

        workers = max(1, min(self.threads, len(per_file)))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            for fut in [pool.submit(one_file, rel, reqs) for rel, reqs in per_file.items()]:
                fut.result()
        done: Future[None] = Future()
        done.set_result(None)
        return done


class _SegFile:
    """A read-only file over in-memory pieces ``[(file offset, memoryview), ...]`` (file order)."""

    def __init__(self, segs: list[tuple[int, memoryview]], size: int) -> None:
        self._segs, self._size, self._pos = segs, size, 0
        self._starts = [off for off, _ in segs]

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = {0: 0, 1: self._pos, 2: self._size}[whence] + pos
        return self._pos

    def tell(self) -> int:
        return self._pos

    def pieces(self, start: int, n: int) -> Iterator[memoryview]:
        """The in-memory pieces covering [start, start + n), in order."""
        i = max(0, bisect.bisect_right(self._starts, start) - 1)
        end = min(start + n, self._size)
        while i < len(self._segs) and start < end:
            off, view = self._segs[i]
            lo, hi = max(start, off), min(end, off + view.nbytes)
            if lo < hi:
                yield view[lo - off : hi - off]
            i += 1

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        got = 0
        for piece in self.pieces(self._pos, out.nbytes):
            out[got : got + piece.nbytes] = piece
            got += piece.nbytes
        self._pos += got
        return got

    def read(self, n: int = -1) -> bytes:
        n = self._size - self._pos if n < 0 else min(n, self._size - self._pos)
        buf = bytearray(max(0, n))
        k = self.readinto(buf)
        return bytes(buf[:k])


class MemReader(FastReader):
    """Loads a checkpoint that ``onepass.read_verified`` already read and verified, from memory.

    Same item handling as FastReader (whole same-dtype tensors are copied straight into the
    destination; everything else, e.g. resharded chunks or dtype changes, goes through torch.load
    and DCP's narrow/copy), with the files' bytes served from the verified in-memory pieces.
    """

    def __init__(self, path: str | os.PathLike[str], loaded: Any, threads: int = 2) -> None:
        super().__init__(path, threads=threads)
        self._loaded = loaded

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        metadata = self._loaded.metadata
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        jobs: list[tuple[Any, Any]] = []
        for req in plan.items:
            md = self.storage_data[req.storage_index]
            if md.transform_descriptors:
                return FileSystemReader.read_data(self, plan, planner)  # stream transforms: DCP's path
            jobs.append((req, md))
        # Big copies first so the pool ends with the small ones.
        jobs.sort(key=lambda j: -j[1].length)

        def one(job: tuple[Any, Any]) -> None:
            req, md = job
            src = self._loaded.files[md.relative_path]
            f = _SegFile(src.segs, src.size)
            if req.type != LoadItemType.BYTE_IO:
                target = self._direct_target(req, planner)
                span = _raw_data_span(f, md.offset, md.length) if target is not None else None
                if target is not None and span is not None and span[1] == target.nbytes:
                    dst = target.reshape(-1).view(torch.uint8)
                    done = 0
                    for piece in f.pieces(span[0], span[1]):
                        n = piece.nbytes
                        dst[done : done + n].copy_(torch.frombuffer(piece, dtype=torch.uint8))
                        done += n
                    if done != span[1]:
                        raise OSError(f"{req.storage_index.fqn}: {done} of {span[1]} bytes in memory")
                    planner.commit_tensor(req, target)
                    return
            f.seek(md.offset)
            _load_item(req, planner, f.read(md.length))

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # frombuffer on pieces of our own mappings
            with ThreadPoolExecutor(max_workers=max(1, self.threads)) as pool:
                for fut in [pool.submit(one, j) for j in jobs]:
                    fut.result()
        done: Future[None] = Future()
        done.set_result(None)
        return done

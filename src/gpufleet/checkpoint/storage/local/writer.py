"""A DCP StorageWriter that checksums every file while writing it (no second read pass).

It is DCP's FileSystemWriter with three changes:
- each shard file goes through a stream that feeds xxh3_64 and counts bytes as the data passes;
  the per-file (size, xxh3) ride back to the coordinator inside the WriteResults and are stripped
  again before ``.metadata`` is pickled, so plain ``dcp.load`` never needs gpufleet installed;
- the coordinator (re)creates the temp directory in ``prepare_global_plan``, i.e. after every rank
  planned and before any rank writes, so a stale temp dir from a killed attempt is never mixed in;
- torch.save's own CRC32 is switched off while writing: xxh3 covers every byte already.
"""

from __future__ import annotations

import dataclasses
import errno
import mmap
import os
import queue
import shutil
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.utils.serialization.config as ser_config
import xxhash
from torch.distributed.checkpoint.filesystem import (
    FileSystemWriter,
    _StorageInfo,
)
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from gpufleet.checkpoint.verify import xxh3_hex

__all__ = ["SummingWriter"]


@dataclasses.dataclass
class _SummedInfo(_StorageInfo):
    """_StorageInfo plus the whole file's size and checksum (only in flight, never in .metadata)."""

    file_bytes: int = 0
    file_xxh3: str = ""


ALIGN = 4096  # O_DIRECT needs file offsets, lengths and memory aligned to the logical block size
_BOUNCE = 8 << 20  # staging buffer for headers, small items and unaligned data
_CHUNK = 32 << 20  # hash-then-write granularity of large direct writes
_DIRECT_MIN = 1 << 20  # tensors at least this large get their data 4 KiB-aligned in the file


def address(view: memoryview) -> int:
    """Memory address of a (possibly read-only) buffer."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0


class _HashingStream:
    """A write-only file that hashes and counts bytes on their way out, with O_DIRECT when possible.

    Bytes are appended in file order through ``write``. Small pieces are gathered in a page-aligned
    bounce buffer and written in whole pages; a large, page-aligned piece that starts at a
    page-aligned file offset is written straight from its own memory (no copy, no page cache).
    The last partial page is padded for the write and cut off again with ftruncate.
    """

    def __init__(self, path: Path, fail: bool, direct: bool = True, tee: Any = None) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        self.direct = False
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self._fd = os.open(path, flags | os.O_DIRECT, 0o644)
                self.direct = True
            except OSError as e:
                if e.errno != errno.EINVAL:  # EINVAL: the filesystem has no O_DIRECT (tmpfs, ...)
                    raise
        if not self.direct:
            self._fd = os.open(path, flags, 0o644)
        self._h = xxhash.xxh3_64()
        self._n = 0  # logical size (bytes accepted)
        self._fail = fail
        self._tee = tee  # optional sink fed every byte in file order (the S3 streaming upload)
        self._mm = mmap.mmap(-1, _BOUNCE)  # page-aligned
        self._bounce = memoryview(self._mm)
        self._fill = 0  # bytes in the bounce; the bounce starts at file offset _n - _fill (aligned)

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        if self._fail:
            raise OSError(errno.EIO, "injected checkpoint write failure (fault=fail)")
        whole = 0
        if view.nbytes >= _DIRECT_MIN:
            if not self.direct:
                self._flush(partial=True)
                whole = view.nbytes
            elif self._n % ALIGN == 0 and address(view) % ALIGN == 0:
                self._flush()  # the bounce holds whole pages only here: it empties
                whole = view.nbytes - view.nbytes % ALIGN
        if whole:
            for i in range(0, whole, _CHUNK):
                part = view[i : min(whole, i + _CHUNK)]
                self._h.update(part)
                if self._tee is not None:
                    self._tee.write(part)
                self._write_all(part)
                self._n += part.nbytes
            view = view[whole:]
        while view:
            k = min(view.nbytes, _BOUNCE - self._fill)
            self._bounce[self._fill : self._fill + k] = view[:k]
            self._h.update(view[:k])
            if self._tee is not None:
                self._tee.write(view[:k])
            self._fill += k
            self._n += k
            view = view[k:]
            if self._fill == _BOUNCE:
                self._flush()
        return self._n

    def pad_to(self, offset: int) -> None:
        """Append zero bytes up to file offset ``offset`` (gaps between DCP items are never read)."""
        while self._n < offset:
            self.write(bytes(min(offset - self._n, _BOUNCE)))

    def _flush(self, partial: bool = False) -> None:
        """Write the whole pages in the bounce (everything if ``partial``); keep the rest at its front."""
        whole = self._fill if partial else self._fill - self._fill % ALIGN
        if whole:
            self._write_all(self._bounce[:whole])
            rest = self._fill - whole
            self._bounce[:rest] = self._bounce[whole : self._fill]
            self._fill = rest

    def _write_all(self, view: memoryview) -> None:
        while view:
            k = os.write(self._fd, view)
            if k <= 0:
                raise OSError(errno.EIO, "short write")
            view = view[k:]

    def tell(self) -> int:
        return self._n

    def flush(self) -> None:
        return None

    def writable(self) -> bool:
        return True

    def finish(self) -> tuple[int, str]:
        self._flush(partial=not self.direct)
        if self._fill:  # O_DIRECT: pad the partial last page for the write, then cut the file to size
            pad = -self._fill % ALIGN
            self._bounce[self._fill : self._fill + pad] = bytes(pad)
            self._write_all(self._bounce[: self._fill + pad])
            self._fill = 0
            os.ftruncate(self._fd, self._n)
        os.fsync(self._fd)
        return self._n, xxh3_hex(self._h)

    def close(self) -> None:
        os.close(self._fd)
        self._bounce.release()
        self._mm.close()


class _Capture:
    """A stream for torch.save that keeps the small writes and spots the tensor's own data write."""

    def __init__(self, data_ptr: int, nbytes: int) -> None:
        self.head: list[bytes] = []
        self.tail: list[bytes] = []
        self.data_at = -1  # offset of the raw tensor bytes in the record, -1 if not seen
        self._want = (data_ptr, nbytes)
        self._n = 0

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        if self.data_at < 0 and (address(view), view.nbytes) == self._want:
            self.data_at = self._n
        else:
            (self.head if self.data_at < 0 else self.tail).append(bytes(view))
        self._n += view.nbytes
        return view.nbytes

    def tell(self) -> int:
        return self._n

    def flush(self) -> None:
        return None

    def writable(self) -> bool:
        return True


_crc_lock = threading.Lock()
_crc_users = 0


@contextmanager
def _no_torch_crc() -> Iterator[None]:
    """Turn off torch.save's CRC32 while any of our writes runs (refcounted: config is global)."""
    global _crc_users
    with _crc_lock:
        if _crc_users == 0:
            _no_torch_crc.saved = ser_config.save.compute_crc32  # type: ignore[attr-defined]
            ser_config.save.compute_crc32 = False
        _crc_users += 1
    try:
        yield
    finally:
        with _crc_lock:
            _crc_users -= 1
            if _crc_users == 0:
                ser_config.save.compute_crc32 = _no_torch_crc.saved  # type: ignore[attr-defined]


def _write_tensor(stream: _HashingStream, t: torch.Tensor) -> tuple[int, int]:
    """Append ``torch.save(t)`` (one DCP item) to the stream; returns its (offset, length).

    The record is what torch.save produces, byte for byte. For a large tensor it is placed so that
    its raw data starts on a page boundary of the file, and that data is written from the tensor's
    own memory; the zero gap before the record is never read (DCP keeps each item's offset).
    """
    nbytes = t.nbytes
    cap = _Capture(t.data_ptr() if nbytes >= _DIRECT_MIN else -1, nbytes)
    torch.save(t, cap)
    head, tail = b"".join(cap.head), b"".join(cap.tail)
    if cap.data_at < 0:  # small, or the data write was not recognised: the record as it came
        offset = stream.tell()
        stream.write(head)
        return offset, len(head)
    stream.pad_to(stream.tell() + (-(stream.tell() + cap.data_at) % ALIGN))
    offset = stream.tell()
    stream.write(head)
    stream.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    stream.write(tail)
    return offset, len(head) + nbytes + len(tail)


class SummingWriter(FileSystemWriter):
    """FileSystemWriter that records (size, xxh3_64) of every file it writes into ``file_sums``."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        thread_count: int = 4,
        fail: bool = False,
        direct: bool = True,
        tee: Callable[[str], Any] | None = None,
    ) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=thread_count)
        self.fail = fail
        self.direct = direct
        self.tee = tee  # file name -> a sink with write(buffer) fed that file's bytes (or None)
        self.file_sums: dict[str, tuple[int, str]] = {}  # filled on the coordinator by finish()

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # No mkdir / "already exists" check here: the coordinator owns the directory's lifecycle.
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        p = Path(self.path)
        if p.exists():
            shutil.rmtree(p)  # leftovers of a killed attempt at the same step
        p.mkdir(parents=True)
        return super().prepare_global_plan(plans)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        from torch.distributed.checkpoint.filesystem import _split_by_size_and_type

        prefix = plan.storage_data.prefix
        jobs: queue.Queue[tuple[str, list[Any]]] = queue.Queue()
        buckets = [b for b in _split_by_size_and_type(self.thread_count, plan.items) if b]
        for i, bucket in enumerate(buckets):
            jobs.put((f"{prefix}{i}.distcp", bucket))
        results: list[WriteResult] = []
        errors: list[BaseException] = []
        lock = threading.Lock()

        def worker() -> None:
            while True:
                try:
                    name, items = jobs.get_nowait()
                except queue.Empty:
                    return
                try:
                    res = self._write_file(name, items, planner)
                except BaseException as e:  # noqa: BLE001 - re-raised on the calling thread below
                    with lock:
                        errors.append(e)
                    return
                with lock:
                    results.extend(res)

        with _no_torch_crc():
            threads = [threading.Thread(target=worker) for _ in range(max(0, len(buckets) - 1))]
            for t in threads:
                t.start()
            worker()
            for t in threads:
                t.join()
        if errors:
            raise errors[0]
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_file(self, name: str, items: list[Any], planner: SavePlanner) -> list[WriteResult]:
        tee = self.tee(name) if self.tee is not None else None
        stream = _HashingStream(Path(self.path) / name, self.fail, self.direct, tee)
        out: list[WriteResult] = []
        try:
            # Byte items (pickled plain values) first, then tensors, as DCP does.
            ordered = [w for w in items if w.type == WriteItemType.BYTE_IO] + [
                w for w in items if w.type != WriteItemType.BYTE_IO
            ]
            for w in ordered:
                data = planner.resolve_data(w)
                if isinstance(data, torch.Tensor):
                    data = data.detach()
                    if data.device.type != "cpu":
                        data = data.cpu()
                    if data.untyped_storage().nbytes() != data.nbytes or not data.is_contiguous():
                        data = data.clone()  # a view: write only its own bytes
                    offset, length = _write_tensor(stream, data)
                else:
                    offset = stream.tell()
                    stream.write(data.getbuffer())
                    length = stream.tell() - offset
                info = _StorageInfo(name, offset, length)
                out.append(WriteResult(index=w.index, size_in_bytes=length, storage_data=info))
            size, digest = stream.finish()
        finally:
            stream.close()
        return [
            dataclasses.replace(
                r,
                storage_data=_SummedInfo(
                    r.storage_data.relative_path,
                    r.storage_data.offset,
                    r.storage_data.length,
                    r.storage_data.transform_descriptors,
                    file_bytes=size,
                    file_xxh3=digest,
                ),
            )
            for r in out
        ]

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        plain: list[list[WriteResult]] = []
        for per_rank in results:
            rows = []
            for r in per_rank:
                s = r.storage_data
                if isinstance(s, _SummedInfo):
                    self.file_sums[s.relative_path] = (s.file_bytes, s.file_xxh3)
                    s = _StorageInfo(s.relative_path, s.offset, s.length, s.transform_descriptors)
                rows.append(dataclasses.replace(r, storage_data=s))
            plain.append(rows)
        super().finish(metadata, plain)

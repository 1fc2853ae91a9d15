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
import os
import queue
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.utils.serialization.config as ser_config
import xxhash
from torch.distributed.checkpoint.filesystem import (
    FileSystemWriter,
    SerializationFormat,
    _StorageInfo,
    _write_item,
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


class _HashingStream:
    """A write-only binary stream that hashes and counts bytes on their way to the file."""

    def __init__(self, path: Path, fail: bool) -> None:
        self._f = open(path, "wb", buffering=0)  # noqa: SIM115 - closed in close()
        self._h = xxhash.xxh3_64()
        self._n = 0
        self._fail = fail

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        if self._fail:
            raise OSError(errno.EIO, "injected checkpoint write failure (fault=fail)")
        self._h.update(view)
        while view:
            k = self._f.write(view)
            if k is None or k <= 0:
                raise OSError(errno.EIO, "short write")
            view = view[k:]
            self._n += k
        return self._n

    def tell(self) -> int:
        return self._n

    def flush(self) -> None:
        return None

    def writable(self) -> bool:
        return True

    def finish(self) -> tuple[int, str]:
        os.fsync(self._f.fileno())
        return self._n, xxh3_hex(self._h)

    def close(self) -> None:
        self._f.close()


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


class SummingWriter(FileSystemWriter):
    """FileSystemWriter that records (size, xxh3_64) of every file it writes into ``file_sums``."""

    def __init__(self, path: str | os.PathLike[str], *, thread_count: int = 4, fail: bool = False) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=thread_count)
        self.fail = fail
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
        stream = _HashingStream(Path(self.path) / name, self.fail)
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
                    if data.untyped_storage().nbytes() != data.nbytes:
                        data = data.clone()  # a view: write only its own bytes
                out.append(
                    _write_item(self.transforms, stream, data, w, name, SerializationFormat.TORCH_SAVE)  # type: ignore[arg-type]
                )
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

"""Stage a state dict into reusable host buffers, optionally deferring the big copies.

Buffers are allocated once per flattened key (re-allocated only when shape or dtype change) and
pinned when the source lives on an accelerator, so steady-state saves allocate nothing. Tensors whose
key matches ``deferred`` (parameters, optimizer state: unchanged until the next optimizer.step) are
copied on a background thread while the caller's forward/backward runs; everything else is copied
before ``stage`` returns. The caller must not mutate deferred tensors before ``wait`` returns.

A DTensor (FSDP2 ``fully_shard``, tensor parallel) is staged as its local shard only: the buffer
holds this rank's piece, wrapped in a :class:`StagedShard` that DCP writes as that DTensor's chunk
(same global shape and offsets), so the checkpoint is the one a direct ``dcp.save`` would write.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import mmap
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from gpufleet.core.env import Platform

__all__ = ["Stager", "StageJob", "StagedShard", "tensor_layout"]

_ALIGNED_MIN = 1 << 20  # CPU buffers at least this large are page-aligned mappings


class StagedShard(torch.Tensor):
    """A staged copy of one rank's DTensor shard: a plain host tensor that DCP plans and writes as
    that DTensor's chunk. It keeps the DTensor's own write items (computed by DTensor when staged),
    so global shape, offsets and placements are exactly DTensor's; only the data is the copy."""

    @staticmethod
    def of(buffer: torch.Tensor, like: DTensor) -> StagedShard:
        out = buffer.as_subclass(StagedShard)
        # DTensor's checkpoint protocol (public dunders): its write items and chunk, under a dummy fqn.
        out.write_items = like.__create_write_items__("", like)
        out.chunks = like.__create_chunk_list__()
        return out

    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
        return [dataclasses.replace(w, index=dataclasses.replace(w.index, fqn=fqn)) for w in self.write_items]

    def __create_chunk_list__(self) -> list[Any]:
        return list(self.chunks)

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        return self.as_subclass(torch.Tensor)  # a plain tensor: the file must not need gpufleet to load


class StageJob:
    """One staging pass: the staged state dict and the (possibly still running) deferred copy."""

    def __init__(
        self, staged: dict[str, Any], pending: list[tuple[str, torch.Tensor, torch.Tensor]], nbytes: int
    ) -> None:
        self.staged = staged
        self.nbytes = nbytes
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.skipped: frozenset[str] = frozenset()  # keys left live, not copied (``Stager.stage(skip=)``)
        self.at_plan = False  # the deferred copy waits for the save plan (``copy_planned``)
        self.copy_s = 0.0
        self._pending = pending
        self._cuda_event: Any = None

    def start(self, at_plan: bool = False) -> None:
        """Start the deferred copy now on a thread, or (``at_plan``) leave it to ``copy_planned``."""
        if not self._pending:
            self.done.set()
            return
        if any(src.is_cuda for _, src, _ in self._pending):
            # The copy must see the values as of now, not after later kernels on the main stream.
            self._cuda_event = torch.cuda.Event()
            self._cuda_event.record()
        self.at_plan = at_plan
        if not at_plan:
            threading.Thread(target=self._run, name="gpufleet-ckpt-stage", daemon=True).start()

    def copy_planned(self, writes: Callable[[str], bool]) -> None:
        """The deferred copy, once the save plan is known: only the tensors this rank writes. A buffer
        never copied into is never touched either, so its pages never become resident."""
        keep = [p for p in self._pending if writes(p[0])]
        self.nbytes -= sum(dst.nbytes for key, _, dst in self._pending if not writes(key))
        self._pending = keep
        self._run()

    def abandon(self, error: BaseException) -> None:
        """The save failed before its plan: release whoever waits for the copy."""
        if not self.done.is_set():
            self.error = self.error or error
            self._pending = []
            self.done.set()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            if self._cuda_event is not None:
                stream = torch.cuda.Stream()
                stream.wait_event(self._cuda_event)
                with torch.cuda.stream(stream):
                    for _, src, dst in self._pending:
                        dst.copy_(src, non_blocking=True)
                stream.synchronize()
            else:
                with torch.no_grad():
                    for _, src, dst in self._pending:
                        dst.copy_(src)
        except BaseException as e:  # noqa: BLE001 - handed to the persist thread, which reports it
            self.error = e
        finally:
            self._pending = []
            self.copy_s = time.perf_counter() - t0
            self.done.set()


class Stager:
    """Owns the reusable staging buffers of one engine."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    def plain_bytes(
        self, layout: Iterable[tuple[str, tuple[int, ...], torch.dtype, bool]]
    ) -> tuple[int, int]:
        """The plain (not DTensor) tensors of ``layout`` (:func:`tensor_layout`): their bytes, and the
        bytes of those already holding a staging buffer."""
        total = held = 0
        for key, shape, dtype, is_shard in layout:
            if is_shard:
                continue
            n = math.prod(shape) * dtype.itemsize
            total += n
            buf = self.buffers.get(key)
            if buf is not None and tuple(buf.shape) == shape and buf.dtype == dtype:
                held += n
        return total, held

    def buffer_for(self, key: str, t: torch.Tensor) -> torch.Tensor:
        """The staging buffer the next ``stage`` would copy ``t`` (at ``key``) into."""
        return self._buffer(key, t)

    def _buffer(self, key: str, t: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            pin = t.device.type != "cpu" and torch.cuda.is_available()
            if pin or t.nbytes < _ALIGNED_MIN:
                buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            else:
                buf = _page_aligned(t.shape, t.dtype, t.nbytes)
            self.buffers[key] = buf
        return buf

    def stage(
        self,
        state_dict: dict[str, Any],
        deferred: Callable[[str], bool] | None = None,
        skip: Callable[[str], bool] | None = None,
        at_plan: bool = False,
    ) -> StageJob:
        """Copy ``state_dict`` into the buffers. Plain tensors whose key ``skip`` accepts are not copied:
        the staged dict holds the live tensor, which DCP then only plans with (its shape and dtype),
        never reads; the engine skips what another rank writes (replicated DDP state, deduplicated).
        ``at_plan``: the deferred copy waits for ``StageJob.copy_planned`` (the engine's save plan)."""
        pending: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        nbytes = 0
        seen: set[str] = set()
        skipped: set[str] = set()

        def walk(obj: Any, key: str, shard: bool = False) -> Any:
            nonlocal nbytes
            if isinstance(obj, DTensor):  # a shard is this rank's alone: always staged
                return StagedShard.of(walk(obj.to_local(), key, shard=True), obj)
            if isinstance(obj, torch.Tensor):
                src = obj.detach()
                if src.layout != torch.strided:
                    raise TypeError(f"cannot checkpoint non-strided tensor at {key!r}")
                if skip is not None and not shard and skip(key):
                    skipped.add(key)
                    return src
                seen.add(key)
                dst = self._buffer(key, src)
                nbytes += dst.nbytes
                if deferred is not None and deferred(key):
                    pending.append((key, src, dst))
                else:
                    dst.copy_(src)
                return dst
            if isinstance(obj, dict):
                return {k: walk(v, f"{key}.{k}" if key else str(k)) for k, v in obj.items()}
            if isinstance(obj, list | tuple) and any(_has_tensor(v) for v in obj):
                out = [walk(v, f"{key}.{i}") for i, v in enumerate(obj)]
                return out if isinstance(obj, list) else type(obj)(out)
            return copy.deepcopy(obj)  # plain values: snapshot now, they may change right after

        with torch.no_grad():
            staged = walk(state_dict, "")
        for k in [k for k in self.buffers if k not in seen]:
            del self.buffers[k]  # keys that disappeared: free their memory
        job = StageJob(staged, pending, nbytes)
        job.skipped = frozenset(skipped)
        job.start(at_plan)
        return job


def tensor_layout(state_dict: dict[str, Any]) -> tuple[tuple[str, tuple[int, ...], torch.dtype, bool], ...]:
    """Every tensor's staging key, shape, dtype and DTensor-ness: what decides a save plan's items."""
    out: list[tuple[str, tuple[int, ...], torch.dtype, bool]] = []

    def walk(obj: Any, key: str) -> None:
        if isinstance(obj, torch.Tensor):
            out.append((key, tuple(obj.shape), obj.dtype, isinstance(obj, DTensor)))
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{key}.{k}" if key else str(k))
        elif isinstance(obj, list | tuple):
            for i, v in enumerate(obj):
                walk(v, f"{key}.{i}")

    walk(state_dict, "")
    return tuple(out)


def available_memory() -> int | None:
    """This host's available memory (``MemAvailable``, bytes); None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def within_half(each: int, ranks: int, available: int | None, held_each: int = 0) -> bool:
    """Whether ``ranks`` processes of a node holding ``each`` bytes apiece fit in half the memory they
    could use: ``available`` plus what they hold already (``held_each`` apiece). The other half stays
    for everything else the node runs. Unknown ``available`` (no /proc/meminfo): True."""
    return available is None or each * ranks <= (available + held_each * ranks) // 2


def local_ranks(default: int) -> int:
    """Ranks on this node (``LOCAL_WORLD_SIZE``, which torchrun and every gpufleet backend set)."""
    ranks = Platform.LOCAL_WORLD_SIZE.get()
    return ranks if ranks is not None and ranks > 0 else default


def _page_aligned(shape: torch.Size, dtype: torch.dtype, nbytes: int) -> torch.Tensor:
    """An uninitialised CPU tensor in its own anonymous mapping: page-aligned, so the writer can
    hand it to O_DIRECT without a copy; transparent huge pages where the kernel allows them."""
    mm = mmap.mmap(-1, nbytes)
    if nbytes >= 2 << 20 and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # frombuffer warns about buffers it cannot prove writable
        flat = torch.frombuffer(mm, dtype=torch.uint8)  # keeps ``mm`` alive as long as the tensor
    return flat.view(dtype).view(shape)


def _has_tensor(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, dict):
        return any(_has_tensor(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return any(_has_tensor(v) for v in obj)
    return False

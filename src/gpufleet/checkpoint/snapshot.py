"""A rank's own copy of its newest committed checkpoint, kept in its process for in-place rollback.

Under ``--in-process-restart`` a surviving rank rolls back to the newest commit without reading it
back: the engine keeps (``CheckpointConfig.keep_snapshot``) the staged copy it wrote that commit
from, every tensor of it (not only the part DCP's deduplication gave this rank to write). The
staging buffers are the bytes the checkpoint's files and their manifest checksums were made from;
once the commit is known, each buffer gets an xxh3 digest, checked again before the copy back, so
what reaches the live tensors is verifiably what was committed. The next save's staging overwrites
the buffers: the engine drops the snapshot before it stages, and only a commit makes a new one.

Nothing here reads storage: a rank without a valid snapshot (a save in flight when the peer died,
a digest mismatch) restores through :meth:`CheckpointEngine.load` like any other.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

__all__ = ["Snapshot", "SnapshotMismatch", "digest"]


class SnapshotMismatch(Exception):
    """The snapshot does not fit the live objects, or a buffer no longer matches its digest."""


def digest(t: torch.Tensor) -> int:
    """xxh3_64 of a host tensor's bytes."""
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return xxhash.xxh3_64_intdigest(b"")
    return xxhash.xxh3_64_intdigest(memoryview(flat.view(torch.uint8).numpy()))


def _tensors(obj: Any, key: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield key, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{key}.{k}" if key else str(k))
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{key}.{i}")


@dataclass(kw_only=True, slots=True)
class Snapshot:
    """The staged state dict of one committed step, with a digest per tensor."""

    step: int  # the committed step it is a copy of
    path: str  # that commit's directory
    meta: dict[str, Any]  # the commit's metadata (epoch, DDP bucket layout, ...)
    staged: dict[str, Any] = field(repr=False)  # nested like the saved state dict; tensors are buffers
    digests: dict[str, int] = field(repr=False)

    @classmethod
    def of(cls, step: int, path: str, meta: dict[str, Any], staged: dict[str, Any]) -> Snapshot:
        return cls(
            step=step,
            path=path,
            meta=meta,
            staged=staged,
            digests={k: digest(t) for k, t in _tensors(staged)},
        )

    def verify(self) -> str | None:
        """None when every buffer still matches its digest; else which one does not."""
        for key, t in _tensors(self.staged):
            if self.digests.get(key) != digest(t):
                return f"snapshot buffer {key!r} does not match its digest"
        return None

    def copy_into(self, template: dict[str, Any]) -> dict[str, Any]:
        """Fill ``template`` (live references, as a load's template) from the snapshot, in place as a
        DCP load would: tensors copied into, plain values replaced by copies. Raises
        :class:`SnapshotMismatch` when keys, shapes or dtypes differ (the caller then loads from storage)."""

        def fill(live: Any, saved: Any, key: str) -> Any:
            if isinstance(live, torch.Tensor):
                if (
                    not isinstance(saved, torch.Tensor)
                    or saved.shape != live.shape
                    or saved.dtype != live.dtype
                ):
                    raise SnapshotMismatch(f"{key!r} differs from the snapshot")
                with torch.no_grad():
                    live.detach().copy_(saved)
                return live
            if isinstance(live, dict):
                if not isinstance(saved, dict) or set(saved) != set(live):
                    raise SnapshotMismatch(f"{key!r}: keys differ from the snapshot")
                for k in live:
                    live[k] = fill(live[k], saved[k], f"{key}.{k}" if key else str(k))
                return live
            if isinstance(live, list | tuple) and any(isinstance(v, torch.Tensor) for v in live):
                if not isinstance(saved, list | tuple) or len(saved) != len(live):
                    raise SnapshotMismatch(f"{key!r}: length differs from the snapshot")
                out = [fill(a, b, f"{key}.{i}") for i, (a, b) in enumerate(zip(live, saved, strict=True))]
                return out if isinstance(live, list) else type(live)(out)
            return copy.deepcopy(saved)

        self.check(template)  # before the first copy: a mismatch leaves the live objects untouched
        return fill(template, self.staged, "")

    def check(self, template: dict[str, Any]) -> None:
        """Raise :class:`SnapshotMismatch` unless ``template`` has the snapshot's tensors (keys, shapes,
        dtypes): what :meth:`copy_into` needs to succeed."""
        live = {k: (t.shape, t.dtype) for k, t in _tensors(template)}
        saved = {k: (t.shape, t.dtype) for k, t in _tensors(self.staged)}
        if live != saved:
            diff = sorted(set(live) ^ set(saved)) or sorted(k for k in live if live[k] != saved[k])
            raise SnapshotMismatch(f"{diff[0]!r} differs from the snapshot")

"""Rolling back in place without reading the checkpoint: state a rank already holds.

An in-process restart's round is survivors, which keep their objects, and hot spares, which built
theirs before the failure (train/recovery.py). Both can hold the newest commit before the round starts:

- a survivor, its engine's :class:`~gpufleet.checkpoint.snapshot.Snapshot`: the staged copy it wrote
  that commit from, checked against a digest per buffer, copied back into its objects;
- a hot spare, what :class:`Preloader` loaded into its objects while it waited for its promotion:
  each new commit read on its own (no group: it has none yet) and verified against the manifest's
  checksums, in a background thread at idle priority.

The round then restores without storage only if every rank holds the same step and it is the newest
commit on disk (:func:`agree`, one small all-reduce); any other case (a save in flight when the peer
died, a spare that missed the newest commit, a digest mismatch) loads from storage as before, and the
preloaded objects are simply overwritten.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gpufleet.checkpoint.manifest import list_committed
from gpufleet.train.priority import restore_threads, set_idle

__all__ = ["Held", "Preloader", "agree", "commit_bytes", "newest_commit"]

_PRELOAD_POLL_S = 0.1  # how often a waiting spare looks for a new commit (a directory listing)


@dataclass(kw_only=True, slots=True)
class Held:
    """A commit loaded into a spare's objects ahead of its promotion."""

    step: int
    path: str
    source: str  # where the preload read it: memory, local, s3
    meta: dict[str, Any] = field(repr=False)
    skips: list[list[int]] = field(default_factory=list)  # the checkpoint's skip windows


def newest_commit(ckpt_dir: str | Path, max_step: int | None = None) -> int | None:
    """The newest committed step on disk at or below ``max_step`` (manifests only, not verified)."""
    for _, m in list_committed(Path(ckpt_dir)):
        if max_step is None or m.step <= max_step:
            return int(m.step)
    return None


def commit_bytes(ckpt_dir: str | Path, step: int) -> int | None:
    """Commit ``step``'s size on disk (its manifest's files), or None if it is not committed."""
    for _, m in list_committed(Path(ckpt_dir)):
        if m.step == step:
            return m.total_bytes
    return None


def agree(held: int | None, newest: int | None, group: Any) -> bool:
    """Whether every rank of the round holds the same step and it is the newest commit any rank sees.
    A collective on ``group`` (CPU): every rank of the round calls it at the same point."""
    h = -1 if held is None else held
    n = -1 if newest is None else newest
    t = torch.tensor([h, -h, n], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    most, least, newest_any = int(t[0]), -int(t[1]), int(t[2])
    return least == most == newest_any >= 0


class Preloader:
    """A hot spare's background loads of each new commit into its objects while it waits.

    ``load(step)`` is the spare's own verified load of commit ``step`` (it returns what it loaded, or
    None); it runs on this thread only while the main thread waits for the promotion order, and once
    more from the main thread afterwards (:meth:`catch_up`), so the objects are never shared."""

    def __init__(
        self, ckpt_dir: str | Path, max_step: int | None, load: Callable[[int], Held | None]
    ) -> None:
        self.ckpt_dir = Path(ckpt_dir)
        self.max_step = max_step
        self._load = load
        self.held: Held | None = None
        self.error: str | None = None  # the last preload's failure (the spare loads as usual then)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpufleet-spare-preload", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> Held | None:
        """Stop looking; wait for a load in progress. Returns what the objects hold."""
        self._stop.set()
        if self._thread.is_alive():
            restore_threads()  # where permitted: a load in progress finishes at normal priority
            self._thread.join()
        return self.held

    def catch_up(self, max_step: int | None) -> Held | None:
        """One more look, on the calling thread, after the order: a commit the thread had not seen yet."""
        self.max_step = max_step
        self._once()
        return self.held

    def _once(self) -> None:
        newest = newest_commit(self.ckpt_dir, self.max_step)
        if newest is None or (self.held is not None and self.held.step == newest):
            return
        self.held = None  # the objects change under a failed load
        try:
            self.held = self._load(newest)
            self.error = None
        except Exception as e:  # noqa: BLE001 - a preload never fails the spare: the round loads as usual
            self.error = f"{type(e).__name__}: {e}"

    def _run(self) -> None:
        set_idle()  # the training ranks come first; a spare's load uses what they leave idle
        while not self._stop.is_set():
            self._once()
            self._stop.wait(_PRELOAD_POLL_S)

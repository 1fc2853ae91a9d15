"""Exact resume for a standard ``torch.utils.data.DataLoader``: ``batches = gpufleet.resumable(loader)``.

The wrapper iterates the loader epoch after epoch and counts the batches it has handed out. Its
``state_dict`` is the position (epoch, batches taken in that epoch) plus the state, taken at the
start of that epoch, of every random generator the loader draws from: the loader's and samplers'
``torch.Generator`` objects and torch's global generator (used when no generator was given).

On resume it replays the interrupted epoch: it puts those generators back to their epoch-start
state, starts the epoch (so the sampler draws the same permutation and the workers get the same
base seed), skips the batches already taken, and puts torch's global generator back to where the
checkpoint left it. Two ways to skip (``replay=``):

- ``"indices"`` (default, map-style datasets): the skipped batches' indices are drawn from the
  sampler and dropped before any worker sees them; no sample is loaded. Cost: one pass of the
  sampler over the skipped part of the epoch (microseconds per batch).
- ``"batches"`` (always for iterable-style datasets): the skipped batches are loaded and dropped.
  Cost: loading them again. Exact even for random augmentation inside worker processes, because
  every worker sees the same items in the same order as before.

``num_workers`` >= 1 is exact too: a batch counts as taken when the wrapper hands it out, not when
a worker prefetched it, and the replay restarts the prefetch from the next batch.

The checkpoint ``run.steps`` takes at step S holds the loader after step S-1's batch: take the
batch inside the loop body (``next(batches)``, or ``zip(run.steps(...), batches)``).

Another world size: the position is also saved in global samples (``shared_state_dict``: epoch and
the samples of its ``DistributedSampler`` order all ranks consumed, equal on every rank). With a
``DistributedSampler`` as the loader's sampler, a run resumed by another number of workers deals the
rest of the interrupted epoch (the same permutation from the next unconsumed sample, padded or
cut to equal shares as ``DistributedSampler`` does) over the new ranks, then runs the following
epochs as the new sampler draws them. Any other sampler's position is per rank: refused.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Iterator
from typing import Any, Literal

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from gpufleet.core.errors import ConfigError

__all__ = ["ResumableLoader", "resumable"]

Replay = Literal["indices", "batches"]
_FORMAT = 1
_END = object()
_NO_HEAD = object()


def resumable(loader: DataLoader, *, replay: Replay = "indices") -> ResumableLoader:
    """Wrap ``loader`` so that its position goes into the checkpoint: put the result in the restore
    dict and take batches from it with ``next()``; it runs through the epochs without end."""
    return ResumableLoader(loader, replay=replay)


class _SkipIterator:
    """Iterates ``source`` after dropping its first ``n`` items. ``prime()`` does the dropping (and
    draws the first item kept) at once, so samplers draw their random numbers at a chosen moment."""

    def __init__(self, source: Iterator[Any], n: int) -> None:
        self._src = source
        self._n: int | None = n
        self._head: Any = _NO_HEAD

    def __iter__(self) -> _SkipIterator:
        return self

    def prime(self) -> None:
        if self._n is None:
            return
        n, self._n = self._n, None
        for _ in range(n):
            if next(self._src, _END) is _END:
                self._head = _END
                return
        self._head = next(self._src, _END)

    def __next__(self) -> Any:
        self.prime()
        head, self._head = self._head, _NO_HEAD
        if head is _END:
            self._head = _END
            raise StopIteration
        if head is not _NO_HEAD:
            return head
        return next(self._src)


class _SkipFirst:
    """Stands in for the loader's (batch) sampler while a replayed epoch starts: every iterator made
    then skips ``n`` batches; once disarmed it only passes the sampler through."""

    def __init__(self, inner: Any, n: int) -> None:
        self.inner = inner
        self.n = n
        self.made: list[_SkipIterator] = []

    def __iter__(self) -> Iterator[Any]:
        if self.n == 0:
            return iter(self.inner)
        it = _SkipIterator(iter(self.inner), self.n)
        self.made.append(it)
        return it

    def __len__(self) -> int:
        return len(self.inner)


class _RestOfEpoch:
    """Stands in for the loader's (batch) sampler for one epoch: the first iteration yields ``first``
    (the rest of a resharded epoch), every later one the sampler itself (persistent workers keep it)."""

    def __init__(self, inner: Any, first: list[Any]) -> None:
        self.inner = inner
        self.first: list[Any] | None = first

    def __iter__(self) -> Iterator[Any]:
        first, self.first = self.first, None
        return iter(first) if first is not None else iter(self.inner)

    def __len__(self) -> int:
        return len(self.inner)


def _sized_len(obj: Any) -> int | None:
    try:
        return len(obj)
    except TypeError:
        return None


class ResumableLoader:
    """A DataLoader's batches across epochs, resumable at the exact next batch. See the module doc."""

    per_rank = True  # each rank's loader has its own position and generators

    def __init__(self, loader: DataLoader, *, replay: Replay = "indices") -> None:
        if not isinstance(loader, DataLoader):
            raise ConfigError(f"gpufleet.resumable() needs a torch.utils.data.DataLoader, not {type(loader)}")
        if replay not in ("indices", "batches"):
            raise ConfigError(f"replay must be 'indices' or 'batches', not {replay!r}")
        self.loader = loader
        self._iterable = isinstance(loader.dataset, IterableDataset)
        self.replay: Replay = "batches" if self._iterable else replay
        self.epoch = 0
        self.batch = 0  # batches handed out in this epoch
        self._started = False  # has this epoch's iterator been made (here or before the checkpoint)
        self._it: Iterator[Any] | None = None
        self._epoch_rng: dict[str, bytes] = {}
        self._pending_replay = False
        # global samples of this epoch's DistributedSampler order consumed before this rank's
        # iterator started (a resume at another world size: the epoch goes on from there)
        self._offset = 0
        self._offset_world: int | None = None  # the world size whose batches ``batch`` counts
        self._pending_rest: int | None = None  # resume the epoch at this global sample

    # ------------------------------------------------------------------ facts about the loader
    @property
    def steps_per_epoch(self) -> int | None:
        """Batches per epoch (``len(loader)``, after ``drop_last``), or None when the loader has no length."""
        return _sized_len(self.loader)

    @property
    def follows_world_size(self) -> bool:
        """Can this loader resume at another world size (its sampler is a DistributedSampler)?"""
        return isinstance(self.loader.sampler, DistributedSampler) and self.loader.batch_size is not None

    def _world(self) -> int:
        sampler = self.loader.sampler
        return sampler.num_replicas if isinstance(sampler, DistributedSampler) else 1

    def _consumed(self) -> int:
        """Global samples of this epoch's order taken by all ranks so far."""
        world = self._offset_world if self._offset_world is not None else self._world()
        return self._offset + self.batch * int(self.loader.batch_size or 1) * world

    def _generators(self) -> dict[str, torch.Generator]:
        """The generators the loader draws from, named by where they sit (each object once)."""
        loader = self.loader
        batch_sampler = loader.batch_sampler
        places = {
            "loader": loader.generator,
            "sampler": getattr(loader.sampler, "generator", None),
            "batch_sampler": getattr(batch_sampler, "generator", None),
            "batch_sampler.sampler": getattr(getattr(batch_sampler, "sampler", None), "generator", None),
        }
        out: dict[str, torch.Generator] = {}
        seen: set[int] = set()
        for name, g in places.items():
            if isinstance(g, torch.Generator) and id(g) not in seen:
                seen.add(id(g))
                out[name] = g
        return out

    def _capture_rng(self) -> dict[str, bytes]:
        states = {name: g.get_state() for name, g in self._generators().items()}
        states["torch"] = torch.get_rng_state()
        return {k: v.numpy().tobytes() for k, v in states.items()}

    def _set_epoch(self) -> None:
        """``set_epoch`` on the sampler, batch sampler and dataset that have one (DistributedSampler)."""
        loader = self.loader
        seen: set[int] = set()
        for obj in (loader.sampler, loader.batch_sampler, getattr(loader.batch_sampler, "sampler", None)):
            if obj is not None and id(obj) not in seen and callable(getattr(obj, "set_epoch", None)):
                seen.add(id(obj))
                obj.set_epoch(self.epoch)

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> ResumableLoader:
        return self

    def __next__(self) -> Any:
        if self._it is None:
            self._begin_epoch()
        assert self._it is not None
        item = next(self._it, _END)
        if item is _END:
            if self.batch == 0:
                raise ConfigError("the data loader yielded no batch in a whole epoch (empty dataset?)")
            self.epoch += 1
            self.batch = 0
            self._offset, self._offset_world = 0, None
            self._started = False
            self._begin_epoch()
            item = next(self._it, _END)
            if item is _END:
                raise ConfigError(f"the data loader yielded no batch in epoch {self.epoch}")
        self.batch += 1
        return item

    def _begin_epoch(self) -> None:
        if self._pending_rest is not None:
            position, self._pending_rest = self._pending_rest, None
            self._pending_replay = False
            if self._rest_of_epoch(position):
                return
            self.epoch += 1  # nothing of that epoch left for anyone: the next one, as usual
            self.batch, self._offset, self._offset_world, self._started = 0, 0, None, False
        if self._pending_replay:
            self._pending_replay = False
            self._replay()
            return
        self._epoch_rng = self._capture_rng()
        self._started = True
        self._set_epoch()
        self._it = iter(self.loader)

    def _replay(self) -> None:
        """Restart the interrupted epoch from its generators' saved state and skip ``self.batch`` batches."""
        gens = self._generators()
        missing = set(self._epoch_rng) - set(gens) - {"torch"}
        if missing:
            raise ConfigError(f"the data loader lost its generator(s) {sorted(missing)} since the checkpoint")
        now = torch.get_rng_state()  # where the checkpoint left the global generator (RNGState restored it)
        loader = self.loader
        saved_gen = loader.generator
        try:
            for name, raw in self._epoch_rng.items():
                state = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
                if name == "torch":
                    torch.set_rng_state(state)
                else:
                    gens[name].set_state(state)
            # With persistent workers only the run's first epoch made a new iterator (which draws the
            # workers' base seed from loader.generator); later epochs reuse it without a draw. Starting
            # a later epoch here makes a new iterator: that draw comes from a throwaway generator.
            if (
                loader.persistent_workers
                and loader.num_workers > 0
                and self.epoch > 0
                and saved_gen is not None
            ):
                loader.generator = torch.Generator().manual_seed(self.epoch)
            self._set_epoch()
            if self.replay == "batches":
                it = iter(loader)
                for _ in range(self.batch):
                    if next(it, _END) is _END:
                        raise ConfigError(_short_epoch(self.epoch, self.batch))
                self._it = it
            else:
                self._it = self._iter_skipping(self.batch)
        finally:
            loader.generator = saved_gen
            torch.set_rng_state(now)

    def _rest_of_epoch(self, position: int) -> bool:
        """Start this epoch at global sample ``position`` of its DistributedSampler order, dealt over
        this run's ranks; False when nothing is left of it."""
        loader = self.loader
        sampler = loader.sampler
        assert isinstance(sampler, DistributedSampler)
        # the epoch's whole order, as DistributedSampler itself draws it (one replica, no padding)
        whole = DistributedSampler(
            sampler.dataset, num_replicas=1, rank=0, shuffle=sampler.shuffle, seed=sampler.seed
        )
        whole.set_epoch(self.epoch)
        rest = list(whole)[position:]
        world, rank = sampler.num_replicas, sampler.rank
        if sampler.drop_last:
            rest = rest[: len(rest) - len(rest) % world]
        elif rest:
            pad = -len(rest) % world
            rest += (rest * math.ceil(pad / len(rest)))[:pad]
        mine = rest[rank::world]
        if not mine:
            return False
        size = int(loader.batch_size or 1)
        batches = [mine[i : i + size] for i in range(0, len(mine), size)]
        if loader.drop_last and len(batches[-1]) < size:
            batches.pop()
        if not batches:
            return False
        self._epoch_rng = self._capture_rng()
        self._started = True
        self._offset, self._offset_world, self.batch = position, world, 0
        self._set_epoch()
        now = torch.get_rng_state()  # making the iterator draws a base seed: keep the global stream
        original = loader.batch_sampler
        object.__setattr__(loader, "batch_sampler", _RestOfEpoch(original, batches))
        try:
            self._it = iter(loader)
        finally:
            object.__setattr__(loader, "batch_sampler", original)
            torch.set_rng_state(now)
        return True

    def _iter_skipping(self, n: int) -> Iterator[Any]:
        loader = self.loader
        attr = "batch_sampler" if loader.batch_sampler is not None else "sampler"
        original = getattr(loader, attr)
        skipper = _SkipFirst(original, n)
        # DataLoader refuses to swap its sampler after __init__; the swap lasts only while the
        # epoch's iterator is made, and the iterator keeps a pass-through once disarmed.
        object.__setattr__(loader, attr, skipper)
        try:
            it = iter(loader)
            # The iterator in use is the last one made (a multi-worker loader makes one, drops it and
            # makes another, which its prefetch already pulled). A single-process loader first pulls
            # at next(): pull now, while the epoch-start generators are in place.
            if skipper.made:
                skipper.made[-1].prime()
        finally:
            object.__setattr__(loader, attr, original)
            skipper.n = 0
        return it

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            "format": _FORMAT,
            "epoch": self.epoch,
            "batch": self.batch,
            "started": self._started,
            "num_samples": _sized_len(self.loader.dataset),
            "batches_per_epoch": self.steps_per_epoch,
            "rng": pickle.dumps(self._epoch_rng),
            "offset": self._offset,
            "offset_world": self._offset_world,
        }

    def shared_state_dict(self) -> dict[str, Any]:
        """The position in global samples, equal on every rank (saved once for all ranks)."""
        return {
            "format": _FORMAT,
            "epoch": self.epoch,
            "consumed": self._consumed(),
            "world_size": self._world(),
            "num_samples": _sized_len(self.loader.dataset),
        }

    def load_shared_state_dict(self, sd: dict[str, Any]) -> None:
        """Resume at another world size from the global position (a DistributedSampler only)."""
        if not self.follows_world_size:
            raise ConfigError(
                "this data loader's position is per rank and does not carry over to another number of "
                "workers: give it a DistributedSampler, or use gpufleet.StepSampler"
            )
        if sd.get("format") != _FORMAT:
            raise ConfigError(f"unknown data loader state format {sd.get('format')!r}")
        samples = _sized_len(self.loader.dataset)
        if sd["num_samples"] != samples:
            raise ConfigError(
                f"the data loader changed since the checkpoint (samples {sd['num_samples']} -> {samples}); "
                "resuming it would repeat or skip samples"
            )
        self._drop_iterator()
        self.epoch = int(sd["epoch"])
        self.batch, self._offset, self._offset_world = 0, 0, None
        self._pending_replay = False
        self._pending_rest = int(sd["consumed"])

    def _drop_iterator(self) -> None:
        self._it = None  # an iterator already running (and its workers) is dropped
        if getattr(self.loader, "_iterator", None) is not None:
            self.loader._iterator = None  # a persistent-workers iterator would ignore the replay

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.get("format") != _FORMAT:
            raise ConfigError(f"unknown data loader state format {sd.get('format')!r}")
        samples, batches = _sized_len(self.loader.dataset), self.steps_per_epoch
        if sd["num_samples"] != samples or sd["batches_per_epoch"] != batches:
            raise ConfigError(
                "the data loader changed since the checkpoint "
                f"(samples {sd['num_samples']} -> {samples}, batches per epoch {sd['batches_per_epoch']} -> "
                f"{batches}); resuming it would repeat or skip samples. Keep the dataset and batch size, "
                "or start a new run directory"
            )
        if self.steps_per_epoch is not None and int(sd["batch"]) > self.steps_per_epoch:
            raise ConfigError(_short_epoch(int(sd["epoch"]), int(sd["batch"])))
        self._drop_iterator()
        self.epoch = int(sd["epoch"])
        self.batch = int(sd["batch"])
        self._started = bool(sd["started"])
        self._epoch_rng = pickle.loads(sd["rng"])
        self._pending_replay = self._started
        self._offset, self._offset_world = int(sd.get("offset", 0)), sd.get("offset_world")
        self._pending_rest = None
        if self._offset:  # inside an epoch resharded at its start: go on in global samples
            self._pending_rest = self._consumed()
            self.batch, self._offset, self._offset_world = 0, 0, None


def _short_epoch(epoch: int, batch: int) -> str:
    return f"epoch {epoch} has fewer than the {batch} batches the checkpoint had taken: did the data change?"

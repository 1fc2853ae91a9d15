"""gpufleet.resumable(DataLoader): a resumed iteration equals the uninterrupted one, batch by batch.

Each "process" starts as a fresh one would (torch.manual_seed, a new loader and wrapper); a
checkpoint is the wrapper's state_dict plus torch's global RNG state (what RNGState saves), taken
through a pickle round trip. Every step also draws from the global RNG (as dropout would), so
the test sees whether the loader's replay disturbs the training's random stream.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, Sampler, TensorDataset

import gpufleet
from gpufleet.core.errors import ConfigError
from gpufleet.train.data import ResumableLoader

N, BS = 37, 4


class ShuffleWithOwnGenerator(Sampler[int]):
    """A custom sampler: a permutation per epoch from its own generator."""

    def __init__(self, n: int, seed: int) -> None:
        self.n = n
        self.generator = torch.Generator().manual_seed(seed)

    def __iter__(self) -> Iterator[int]:
        yield from torch.randperm(self.n, generator=self.generator).tolist()

    def __len__(self) -> int:
        return self.n


class NoisyDataset(Dataset):
    """Random augmentation inside __getitem__ (runs in the worker processes)."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[int, float]:
        return i, float(torch.rand(()))


class Stream(IterableDataset):
    def __iter__(self) -> Iterator[tuple[int, float]]:
        for i in range(N):
            yield i, float(torch.rand(()))


def _ds() -> TensorDataset:
    return TensorDataset(torch.arange(N))


LOADERS: dict[str, Callable[[int, bool], DataLoader]] = {
    "shuffle_generator": lambda nw, dl: DataLoader(
        _ds(), BS, shuffle=True, generator=torch.Generator().manual_seed(5), num_workers=nw, drop_last=dl
    ),
    "shuffle_global_rng": lambda nw, dl: DataLoader(_ds(), BS, shuffle=True, num_workers=nw, drop_last=dl),
    "custom_sampler": lambda nw, dl: DataLoader(
        _ds(), BS, sampler=ShuffleWithOwnGenerator(N, 9), num_workers=nw, drop_last=dl
    ),
    "distributed_sampler": lambda nw, dl: DataLoader(
        _ds(),
        BS,
        sampler=DistributedSampler(_ds(), num_replicas=2, rank=1, seed=3),
        num_workers=nw,
        drop_last=dl,
    ),
    "persistent_workers": lambda nw, dl: DataLoader(
        _ds(),
        BS,
        shuffle=True,
        generator=torch.Generator().manual_seed(5),
        num_workers=max(nw, 1),
        persistent_workers=True,
        drop_last=dl,
    ),
}


def _fresh(make: Callable[[], DataLoader], **kw: Any) -> ResumableLoader:
    torch.manual_seed(0)  # what a freshly started training script does
    return gpufleet.resumable(make(), **kw)


def _item(batch: Any) -> list[Any]:
    return [t.tolist() if isinstance(t, torch.Tensor) else t for t in batch]


def _take(w: ResumableLoader, n: int) -> list[Any]:
    out = []
    for _ in range(n):
        out.append(_item(next(w)))
        out.append(torch.rand(2).tolist())  # the training's own draws (dropout)
    return out


def _checkpoint(w: ResumableLoader) -> bytes:
    return pickle.dumps((w.state_dict(), torch.get_rng_state()))


def _resume(make: Callable[[], DataLoader], ckpt: bytes, **kw: Any) -> ResumableLoader:
    w = _fresh(make, **kw)
    sd, rng = pickle.loads(ckpt)
    torch.set_rng_state(rng)  # RNGState sits in the same restore dict
    w.load_state_dict(sd)
    return w


def _check_resumes(make: Callable[[], DataLoader], cuts: list[int], total: int, **kw: Any) -> None:
    reference = _take(_fresh(make, **kw), total)
    for cut in cuts:
        w = _fresh(make, **kw)
        got = _take(w, cut)
        w2 = _resume(make, _checkpoint(w), **kw)
        got += _take(w2, total - cut)
        assert got == reference, f"resume after {cut} batches differs"
    # resumed twice in the same epoch, then across the boundary: the state after a resume is exact too
    a, b = cuts[0], cuts[0] + 2
    w = _fresh(make, **kw)
    got = _take(w, a)
    w = _resume(make, _checkpoint(w), **kw)
    got += _take(w, b - a)
    w = _resume(make, _checkpoint(w), **kw)
    got += _take(w, total - b)
    assert got == reference, "second resume differs"


# In this process (num_workers=0); tests/integration/test_loader_workers.py runs the same cases with
# worker processes.
CASES = [(kind, 0, False) for kind in sorted(LOADERS)] + [("shuffle_generator", 0, True)]
WORKER_CASES = [(kind, 2, False) for kind in sorted(LOADERS)] + [
    ("shuffle_generator", 2, True),
    ("custom_sampler", 2, True),
]


def check_resumes_exactly(kind: str, num_workers: int, drop_last: bool) -> None:
    """A ``kind`` loader resumed mid-epoch, at the boundary and twice in an epoch: the same batches."""
    make = lambda: LOADERS[kind](num_workers, drop_last)  # noqa: E731
    per_epoch = len(make())
    assert gpufleet.resumable(make()).steps_per_epoch == per_epoch
    cuts = [1, per_epoch // 2, per_epoch, per_epoch + 1, 2 * per_epoch - 1]
    _check_resumes(make, cuts, total=3 * per_epoch + 2)


@pytest.mark.parametrize(("kind", "num_workers", "drop_last"), CASES)
def test_resume_mid_epoch_and_at_the_boundary_is_exact(kind: str, num_workers: int, drop_last: bool) -> None:
    check_resumes_exactly(kind, num_workers, drop_last)


def check_random_augmentation(num_workers: int) -> None:
    """Replaying batches gives the same randomly augmented samples, with ``num_workers`` workers."""
    make = lambda: DataLoader(  # noqa: E731
        NoisyDataset(), BS, shuffle=True, generator=torch.Generator().manual_seed(1), num_workers=num_workers
    )
    _check_resumes(make, [3, 10, 13], total=25, replay="batches")


def test_replay_batches_is_exact_for_random_augmentation() -> None:
    check_random_augmentation(0)


def test_iterable_dataset_replays_batches() -> None:
    make = lambda: DataLoader(Stream(), BS)  # noqa: E731
    w = gpufleet.resumable(make())
    assert w.replay == "batches" and w.steps_per_epoch is None
    _check_resumes(make, [2, 10, 11], total=25)


def test_epochs_advance_and_set_epoch_is_called() -> None:
    sampler = DistributedSampler(_ds(), num_replicas=2, rank=0, seed=3)
    w = gpufleet.resumable(DataLoader(_ds(), BS, sampler=sampler))
    per_epoch = w.steps_per_epoch
    assert per_epoch == 5  # ceil(37 / 2) = 19 samples on this rank
    _take(w, per_epoch)
    assert (w.epoch, w.batch, sampler.epoch) == (0, per_epoch, 0)
    _take(w, 1)
    assert (w.epoch, w.batch, sampler.epoch) == (1, 1, 1)


def test_changed_dataset_or_batch_size_is_a_clear_error() -> None:
    w = gpufleet.resumable(DataLoader(_ds(), BS, shuffle=True))
    _take(w, 3)
    sd = w.state_dict()
    bigger = gpufleet.resumable(DataLoader(TensorDataset(torch.arange(N + 8)), BS, shuffle=True))
    with pytest.raises(ConfigError, match="changed since the checkpoint"):
        bigger.load_state_dict(sd)
    other_bs = gpufleet.resumable(DataLoader(_ds(), BS + 1, shuffle=True))
    with pytest.raises(ConfigError, match="batches per epoch 10 -> 8"):
        other_bs.load_state_dict(sd)


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="needs a torch.utils.data.DataLoader"):
        gpufleet.resumable([1, 2, 3])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="replay must be"):
        gpufleet.resumable(DataLoader(_ds()), replay="fast")  # type: ignore[arg-type]
    empty = gpufleet.resumable(DataLoader(TensorDataset(torch.arange(3)), BS, drop_last=True))
    with pytest.raises(ConfigError, match="no batch"):
        next(empty)


def test_a_bare_dataloader_in_the_restore_dict_says_how_to_wrap_it() -> None:
    from gpufleet.train.statedict import StateMapper

    with pytest.raises(ConfigError, match=r"gpufleet.resumable\(loader\)"):
        StateMapper({"data": DataLoader(_ds(), BS)}, rank=0)
    mapper = StateMapper({"data": gpufleet.resumable(DataLoader(_ds(), BS))}, rank=1)
    assert set(mapper.collect()["data"]) == {"rank1", "shared"}  # per rank, and the global position

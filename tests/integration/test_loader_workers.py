"""gpufleet.resumable(DataLoader) with worker processes (num_workers=2): the cases of
tests/unit/train/test_loader_resume.py, whose loaders there run in the test's own process, and a resume
with another number of workers than the checkpoint's."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.utils.data import DataLoader

from unit.train.test_loader_resume import (
    BS,
    WORKER_CASES,
    _checkpoint,
    _ds,
    _fresh,
    _resume,
    _take,
    check_random_augmentation,
    check_resumes_exactly,
)

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("kind", "num_workers", "drop_last"), WORKER_CASES)
def test_resume_mid_epoch_and_at_the_boundary_is_exact(kind: str, num_workers: int, drop_last: bool) -> None:
    check_resumes_exactly(kind, num_workers, drop_last)


def test_replay_batches_is_exact_for_random_augmentation_in_workers() -> None:
    check_random_augmentation(2)


def test_resume_with_another_num_workers_is_exact() -> None:
    def make(nw: int) -> Callable[[], DataLoader]:
        return lambda: DataLoader(
            _ds(), BS, shuffle=True, generator=torch.Generator().manual_seed(5), num_workers=nw
        )

    reference = _take(_fresh(make(0)), 25)
    w = _fresh(make(0))
    got = _take(w, 13)
    got += _take(_resume(make(2), _checkpoint(w)), 12)
    assert got == reference

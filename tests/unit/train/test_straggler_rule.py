"""The straggler rule: medians per window against the peers', consecutive windows, once per rank."""

from __future__ import annotations

import random

from gpufleet.core import events as E
from gpufleet.train.straggler import StragglerConfig, StragglerDetector


def feed(det: StragglerDetector, steps: range, timing) -> list[E.Straggler]:  # type: ignore[no-untyped-def]
    found: list[E.Straggler] = []
    for step in steps:
        for rank in det.ranks:
            work, fwd = timing(rank, step)
            found += det.observe(rank, step, work, fwd)
    return found


def test_a_rank_slow_before_the_collective_is_flagged_after_three_windows_once() -> None:
    det = StragglerDetector([0, 1, 2, 3])
    rng = random.Random(0)

    def timing(rank: int, step: int) -> tuple[float, float]:
        fwd = 0.010 * rng.uniform(0.8, 1.2) + (0.030 if rank == 2 else 0.0)
        return 0.050, fwd  # under DDP every rank reaches the control all-reduce together

    found = feed(det, range(59), timing)
    assert found == []  # two full windows (0-19, 20-39) and part of a third: not yet
    found = feed(det, range(59, 200), timing)
    assert [(f.rank, f.section, f.windows, f.step) for f in found] == [(2, E.TimingSection.FWD, 3, 59)]
    assert 3.0 < found[0].ratio < 5.0 and abs(found[0].peers_s - 0.010) < 0.002


def test_noise_and_a_brief_slowdown_are_not_stragglers() -> None:
    det = StragglerDetector([0, 1])
    rng = random.Random(1)

    def timing(rank: int, step: int) -> tuple[float, float]:
        base = 0.020 * rng.uniform(0.5, 1.5)  # +-50% step-to-step jitter on every rank
        if rank == 1 and 40 <= step < 60:
            base *= 3  # one slow window: the OS took its CPU for a while
        return base, base / 2

    assert feed(det, range(400), timing) == []


def test_sub_millisecond_sections_never_flag_and_a_section_not_every_rank_timed_is_skipped() -> None:
    det = StragglerDetector([0, 1], StragglerConfig(window=10, windows=2))

    def timing(rank: int, step: int) -> tuple[float, float | None]:
        work = 0.0004 if rank == 1 else 0.0001  # 4x, but 0.3 ms: below the 5 ms floor
        return work, (0.5 if rank == 1 else None)  # only rank 1 has a forward hook

    assert feed(det, range(100), timing) == []


def test_a_single_rank_has_no_peers() -> None:
    det = StragglerDetector([0])
    assert feed(det, range(100), lambda r, s: (1.0, 1.0)) == []

"""Arrival processes: statistics with fixed seeds, and bad specs."""

from __future__ import annotations

import statistics

import pytest

from gpufleet.core.errors import UsageError
from gpufleet.serve.bench.arrivals import parse_arrival, schedule


def _gaps(offs):
    return [b - a for a, b in zip(offs, offs[1:], strict=False)]


def test_constant_poisson_gamma_rates():
    c = schedule(parse_arrival("constant"), 10, count=11)
    assert c[0] == 0 and c[-1] == pytest.approx(1.0)
    for spec, cv in [("poisson", 1.0), ("gamma:0.25", 2.0), ("gamma:4", 0.5)]:
        g = _gaps(schedule(parse_arrival(spec), 100, count=20001, seed=7))
        mean = statistics.fmean(g)
        assert mean == pytest.approx(0.01, rel=0.05), spec
        assert statistics.pstdev(g) / mean == pytest.approx(cv, rel=0.1), spec


def test_duration_and_seed():
    a = schedule(parse_arrival("poisson"), 50, duration_s=10, seed=1)
    assert 400 < len(a) < 600 and a[-1] < 10
    assert a == schedule(parse_arrival("poisson"), 50, duration_s=10, seed=1)
    assert a != schedule(parse_arrival("poisson"), 50, duration_s=10, seed=2)


@pytest.mark.parametrize("bad", ["uniform", "gamma", "gamma:0", "gamma:-1", "gamma:x", "poisson:2"])
def test_bad_arrivals(bad):
    with pytest.raises(UsageError):
        parse_arrival(bad)


@pytest.mark.parametrize("rate", [0, -5, float("nan"), float("inf")])
def test_bad_rates(rate):
    with pytest.raises(UsageError):
        schedule(parse_arrival("poisson"), rate, count=3)

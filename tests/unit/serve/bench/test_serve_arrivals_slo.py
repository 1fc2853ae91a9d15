"""Arrival processes (statistics with fixed seeds) and SLO / duration parsing."""

from __future__ import annotations

import statistics

import pytest

from gpufleet.core.errors import UsageError
from gpufleet.serve.bench.arrivals import parse_arrival, schedule
from gpufleet.serve.common.slo import parse_duration, parse_slo


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


def test_slo_parse_and_check():
    s = parse_slo("ttft=500ms,tpot=50ms,e2e=10s")
    assert s.as_dict() == {"ttft": 0.5, "tpot": 0.05, "e2e": 10.0}
    assert s.met(0.4, 0.04, 9.0)
    assert not s.met(0.6, 0.04, 9.0) and not s.met(0.4, None, 9.0)
    assert parse_slo("TTFT=200us").ttft == pytest.approx(2e-4)
    assert not parse_slo(None) and parse_slo(None).met(None, None, None)
    assert parse_duration("1.5m") == 90 and parse_duration("2s") == 2


@pytest.mark.parametrize("bad", ["ttft", "ttft=", "ttft=500", "ttft=-5ms", "ttft=0ms", "foo=5ms",
                                 "ttft=5ms,ttft=6ms", "ttft=20s,e2e=1s", "ttft=5parsecs", "tpot=nanms"])
def test_impossible_slo_strings(bad):
    with pytest.raises(UsageError) as e:
        parse_slo(bad)
    assert "\n" not in str(e.value)

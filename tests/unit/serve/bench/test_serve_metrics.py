"""Metric formulas on hand-built request records, and the find-max-rate search logic."""

from __future__ import annotations

import pytest

from gpufleet.serve.bench.client import RequestRecord
from gpufleet.serve.bench.findmax import Level, queue_growing, search_max_rate
from gpufleet.serve.bench.metrics import percentiles, summarize_records
from gpufleet.serve.common.slo import parse_slo


def rec(i, intended, lag, ttft, e2e, out, itl=(), error="", warmup=False):
    return RequestRecord(
        i,
        intended,
        sent_s=intended + lag,
        ttft_s=ttft,
        e2e_s=e2e,
        output_tokens=out,
        token_source="usage" if out else "",
        itl_s=list(itl),
        error=error,
        warmup=warmup,
    )


def test_percentiles_linear():
    p = percentiles([0.001 * x for x in range(1, 101)])
    assert p["p50"] == pytest.approx(50.5) and p["p99"] == pytest.approx(99.01)
    assert p["mean"] == pytest.approx(50.5) and p["count"] == 100
    assert percentiles([])["p50"] is None


def test_formulas():
    recs = [
        rec(0, 0.0, 0.001, 0.1, 1.1, 11, itl=[0.1] * 10),  # tpot = 1.0/10 = 0.1
        rec(1, 1.0, 0.002, 0.3, 0.5, 3, itl=[0.1, 0.1]),  # tpot = 0.2/2 = 0.1
        rec(2, 2.0, 0.003, 0.2, 0.2, 1),  # one token: no tpot
        rec(3, 3.0, 0.0, None, 0.01, None, error="http_500"),
        rec(4, -1.0, 0.0, 9.0, 9.0, 5, warmup=True),  # left out
    ]
    assert recs[0].tpot_s == pytest.approx(0.1) and recs[2].tpot_s is None
    m = summarize_records(recs, parse_slo("ttft=250ms,e2e=1s"), offered_rate=1.0, max_lag_ms=5)
    assert m["requests"] == {"measured": 4, "ok": 3, "failed": 1, "good": 1, "warmup": 1}
    # duration: first intended (0.0) → last end (request 1 ends 1.002 + 0.5; request 3 ends 3.01)
    assert m["duration_s"] == pytest.approx(3.01)
    assert m["slo"]["attainment"] == pytest.approx(1 / 4)  # failed requests count as misses
    assert m["slo"]["goodput_per_s"] == pytest.approx(1 / 3.01)
    assert m["rate"]["request_throughput_per_s"] == pytest.approx(3 / 3.01)
    assert m["tokens"]["output_total"] == 15
    assert m["latency_ms"]["tpot"]["count"] == 2 and m["latency_ms"]["tpot"]["mean"] == pytest.approx(100)
    assert m["latency_ms"]["itl"]["count"] == 12
    assert m["latency_ms"]["ttft"]["p50"] == pytest.approx(200)
    assert m["errors"] == {"http_500": 1}
    assert m["client"]["valid"] and m["client"]["send_lag_ms"]["max"] == pytest.approx(3)


def test_lag_and_send_rate_make_a_run_invalid():
    late = [rec(i, i * 0.01, 0.02 if i % 10 == 0 else 0.0, 0.01, 0.02, 2) for i in range(100)]
    m = summarize_records(late, parse_slo(None), max_lag_ms=5)
    assert not m["client"]["valid"] and "p99 send lag" in m["client"]["invalid_reasons"][0]
    slow = [rec(i, i * 0.01, i * 0.01, 0.01, 0.02, 2) for i in range(100)]  # sends at half the rate
    m = summarize_records(slow, parse_slo(None), max_lag_ms=1e9)
    assert any("achieved send rate" in r for r in m["client"]["invalid_reasons"])
    assert summarize_records(slow, parse_slo(None), max_lag_ms=1e9, open_loop=False)["client"]["valid"]


def test_token_source_worst_wins():
    a = rec(0, 0.0, 0.0, 0.1, 0.2, 4)
    b = rec(1, 0.1, 0.0, 0.1, 0.2, 4)
    b.token_source = "estimate"
    m = summarize_records([a, b], parse_slo(None))
    assert m["tokens"]["source"] == "estimate" and m["tokens"]["sources"] == {"usage": 1, "estimate": 1}


def test_queue_growing():
    flat = [rec(i, i * 0.1, 0.0, 0.05, 0.1, 2) for i in range(30)]
    assert not queue_growing(flat)
    growing = [rec(i, i * 0.1, 0.0, 0.05 + 0.05 * i, 1.0, 2) for i in range(30)]
    assert queue_growing(growing)


def synthetic(capacity: float, noisy_at: float | None = None):
    calls: list[float] = []

    def measure(rate: float) -> Level:
        calls.append(rate)
        att = 1.0 if rate <= capacity else max(0.0, 1 - (rate - capacity) / capacity)
        if noisy_at is not None and abs(rate - noisy_at) < 1e-9 and calls.count(rate) == 2:
            att = 0.5  # the stability re-run fails once
        return Level(rate, att)

    return measure, calls


@pytest.mark.parametrize("cap,start", [(37.0, 1.0), (5.0, 4.0), (0.3, 1.0), (1000.0, 2.0)])
def test_search_finds_capacity_within_tolerance(cap, start):
    measure, calls = synthetic(cap)
    r = search_max_rate(measure, 0.9, start, rel_tol=0.05)
    # attainment >= 0.9 holds up to cap * 1.1
    assert cap * 1.1 / 1.06 <= r.max_rate <= cap * 1.1 and r.stable and r.limited_by == "slo"
    assert r.levels[-1].recheck and len(calls) <= 18  # 16 search levels + rechecks


def test_search_max_rate_bound_and_nothing_passes():
    measure, _ = synthetic(100.0)
    r = search_max_rate(measure, 0.9, 1.0, max_rate=20.0)
    assert r.max_rate == 20.0 and r.limited_by == "max_rate"
    measure, _ = synthetic(0.001)
    r = search_max_rate(measure, 0.9, 1.0)
    assert r.max_rate == 0.0 and r.limited_by == "min_rate"


def test_stability_recheck_steps_down():
    measure, calls = synthetic(37.0)
    first = search_max_rate(measure, 0.9, 1.0).max_rate
    measure, calls = synthetic(37.0, noisy_at=first)
    r = search_max_rate(measure, 0.9, 1.0)
    assert r.max_rate < first and r.stable
    assert sum(1 for lv in r.levels if lv.recheck) == 2


def test_client_limited_search_says_so():
    def measure(rate: float) -> Level:
        return Level(rate, 1.0, client_valid=rate < 50)

    r = search_max_rate(measure, 0.9, 1.0)
    assert r.limited_by == "client" and 45 <= r.max_rate < 50

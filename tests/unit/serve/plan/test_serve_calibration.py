"""The shipped DistServe-calibrated profile against the figures it was fitted to (DistServe, OSDI'24,
Fig. 1: OPT-13B on one A100, input 512, output 64, SLO p90 TTFT 0.4 s / TPOT 0.04 s). Guards the
profile and the simulator together: a change to either that moves these goodputs shows up here."""

from __future__ import annotations

import pytest

from gpufleet.serve.common.slo import SLO
from gpufleet.serve.plan import planner as pl
from gpufleet.serve.plan.evaluate import bisect_max_rate, scaled
from gpufleet.serve.plan.profile import load_profile
from gpufleet.serve.plan.sim import evaluate, simulate_aggregated, simulate_disaggregated
from gpufleet.serve.plan.traffic import parse_traffic

FIG1 = "in=fixed:512;out=fixed:64;cv=1"
BOTH = SLO.of(ttft=0.4, tpot=0.04, percentile=90)


def test_calibrated_profile_reproduces_distserve_fig1_goodputs() -> None:
    prof = load_profile("opt-13b-a100-distserve")
    tp, kv = prof.tps[1], prof.kv_bytes_per_token
    u = parse_traffic(f"rate=1;{FIG1}").unit(3000, 1)
    ttft, tpot = SLO.of(ttft=0.4, percentile=90), SLO.of(tpot=0.04, percentile=90)

    def prefill_only(r: float) -> bool:  # one prefill instance; decode never the bottleneck
        return bool(
            evaluate(simulate_disaggregated(scaled(u, r), tp, 1, 256, tp, 8, 256, kv, 100.0), ttft)["passed"]
        )

    def decode_only(r: float) -> bool:
        return bool(
            evaluate(simulate_disaggregated(scaled(u, r), tp, 8, 256, tp, 1, 256, kv, 100.0), tpot)["passed"]
        )

    def colocated(r: float) -> bool:
        return bool(evaluate(simulate_aggregated(scaled(u, r), tp, 1, 256), BOTH)["passed"])

    got = {f.__name__: bisect_max_rate(f, 2.0, 0.01) for f in (prefill_only, decode_only, colocated)}
    assert got["prefill_only"] == pytest.approx(5.6, rel=0.05)
    assert got["decode_only"] == pytest.approx(10.0, rel=0.05)
    assert got["colocated"] == pytest.approx(1.6, rel=0.05)


def test_planner_picks_distserves_allocation_for_fig1() -> None:
    """DistServe's answer for 10 req/s on this workload: two prefill GPUs and one decode GPU."""
    res = pl.plan(
        load_profile("opt-13b-a100-distserve"), parse_traffic(f"rate=10;{FIG1}"), pl.PlanOptions(BOTH)
    )
    c = res.chosen
    assert c.feasible and c.mode == "disaggregated"
    assert (c.p_replicas, c.p_tp, c.d_replicas, c.d_tp) == (2, 1, 1, 1)
    assert c.max_rate / c.gpus > 1.3 * 1.6  # per GPU, against colocated serving's 1.6 req/s

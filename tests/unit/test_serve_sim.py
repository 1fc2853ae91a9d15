"""The discrete-event simulator against closed-form cases."""

from __future__ import annotations

import numpy as np
import pytest

from gpufleet.serve.profile import Coeffs, TpProfile
from gpufleet.serve.sim import Requests, Slo, evaluate, simulate_aggregated, simulate_disaggregated

TP = TpProfile(1, Coeffs(10.0, 0.1, 0.0), Coeffs(5.0, 0.0, 1.0), max_batch=64)


def _req(arr: list[float], inp: int, out: int) -> Requests:
    n = len(arr)
    return Requests(np.array(arr), np.full(n, inp), np.full(n, out))


def test_single_request_latencies() -> None:
    r = simulate_aggregated(_req([0.0], 100, 11), TP, 1, 64)
    assert r.ttft[0] == pytest.approx(0.020)  # 10 + 0.1*100 ms
    assert r.tpot[0] == pytest.approx(0.006)  # decode step 5 + 1*batch(1) ms


def test_batch_one_is_fifo_queue() -> None:
    # serves one at a time: service = 20 ms prefill + 10 steps * 6 ms = 80 ms; second waits 80 ms
    r = simulate_aggregated(_req([0.0, 0.0], 100, 11), TP, 1, 1)
    assert r.ttft[0] == pytest.approx(0.020) and r.ttft[1] == pytest.approx(0.100)
    assert r.tpot[1] == pytest.approx(0.006)


def test_batching_and_prefill_interference() -> None:
    # two together: one prefill of 200 tokens (30 ms), then decode steps of batch 2 (7 ms)
    r = simulate_aggregated(_req([0.0, 0.0], 100, 11), TP, 1, 64)
    assert r.ttft[0] == pytest.approx(0.030) and r.tpot[0] == pytest.approx(0.007)
    # a late arrival stalls the running decode: TPOT of the first grows
    r2 = simulate_aggregated(_req([0.0, 0.025], 100, 11), TP, 1, 64)
    assert r2.tpot[0] > 0.0065


def test_disaggregated_has_no_interference_and_pays_transfer() -> None:
    req = _req([0.0, 0.025], 100, 11)
    r = simulate_disaggregated(req, TP, 1, 64, TP, 1, 64, kv_bytes_per_token=1e6, kv_gbps=1.0)
    assert r.ttft[1] == pytest.approx(0.020)  # its own prefill instance was idle
    r0 = simulate_disaggregated(req, TP, 1, 64, TP, 1, 64, 0.0, 1.0)
    assert r0.tpot[0] < 0.0075  # the prefill of request 1 did not stall its decode
    # 100 MB at 1 GB/s = 0.1 s between the first token and the decode: in TPOT (10 ms over 10 tokens)
    assert r.tpot[0] == pytest.approx(r0.tpot[0] + 0.010, abs=1e-3)


def test_kv_capacity_limits_admission() -> None:
    small = TpProfile(1, TP.prefill, TP.decode, max_batch=64, kv_capacity_tokens=150)
    r = simulate_aggregated(_req([0.0, 0.0], 100, 11), small, 1, 64)
    assert r.ttft[1] > 0.08  # the second waits for the first to finish


def test_evaluate_attainment_and_overload() -> None:
    slo = Slo({"ttft": (90, 0.05), "tpot": (90, 0.02)}, 0.9)
    rng = np.random.default_rng(0)
    arr = np.cumsum(rng.exponential(1.0, 2000))
    light = simulate_aggregated(Requests(arr / 5, np.full(2000, 100), np.full(2000, 11)), TP, 1, 64)
    ev = evaluate(light, slo)
    assert ev["passed"] and ev["attainment"] > 0.9 and ev["slack"] > 0
    heavy = simulate_aggregated(Requests(arr / 200, np.full(2000, 100), np.full(2000, 11)), TP, 1, 64)
    assert not evaluate(heavy, slo)["passed"]


def test_many_events_are_fast() -> None:
    import time

    rng = np.random.default_rng(1)
    n = 5000
    req = Requests(np.cumsum(rng.exponential(0.02, n)), rng.integers(50, 500, n), rng.integers(20, 300, n))
    t0 = time.perf_counter()
    simulate_aggregated(req, TP, 2, 128)
    assert time.perf_counter() - t0 < 5.0

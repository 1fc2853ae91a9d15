"""The discrete-event simulator against closed-form cases."""

from __future__ import annotations

import numpy as np
import pytest

from gpufleet.serve.common.slo import SLO
from gpufleet.serve.plan.profile import Coeffs, TpProfile
from gpufleet.serve.plan.sim import Requests, evaluate, simulate_aggregated, simulate_disaggregated

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


# -- chunked prefill ------------------------------------------------------------------------------
TPQ = TpProfile(1, Coeffs(10.0, 0.1, 1e-4), Coeffs(5.0, 0.0, 1.0), max_batch=64)  # with an attention term


def test_chunked_prefill_pieces_add_up_to_the_whole_prompt() -> None:
    # one prompt alone: a budget above its length gives exactly the unchunked prefill
    whole = simulate_aggregated(_req([0.0], 1000, 11), TPQ, 1, 64)
    one = simulate_aggregated(_req([0.0], 1000, 11), TPQ, 1, 64, chunk=2048)
    assert one.ttft[0] == pytest.approx(whole.ttft[0]) and one.tpot[0] == pytest.approx(whole.tpot[0])
    # in pieces of 256: 4 iterations, each with the fixed cost; the linear and attention terms
    # telescope to the whole prompt's: 4*10 + 0.1*1000 + 1e-4*1000^2 = 240 ms
    pieces = simulate_aggregated(_req([0.0], 1000, 11), TPQ, 1, 64, chunk=256)
    assert pieces.ttft[0] == pytest.approx(0.240)


def test_chunked_prefill_spreads_a_long_prompt_but_keeps_its_work() -> None:
    # a short request decoding when a 4000-token prompt arrives
    req = Requests(np.array([0.0, 0.05]), np.array([10, 4000]), np.array([60, 2]))
    burst = simulate_aggregated(req, TPQ, 1, 64)
    spread = simulate_aggregated(req, TPQ, 1, 64, chunk=512)
    # Unchunked, the running decode stalls once for the whole prefill (10 + 400 + 1600 ms); chunked,
    # each of its steps carries at most 511 prompt tokens. The same prefill work passes under it
    # either way, so its mean TPOT barely moves: chunking cuts the longest gap, not the mean.
    assert spread.tpot[0] == pytest.approx(burst.tpot[0], rel=0.05)
    # the long prompt is cut into 8 pieces and shares each iteration with the decode: later first token
    assert spread.ttft[1] > burst.ttft[1]


def test_kv_capacity_limits_admission() -> None:
    small = TpProfile(1, TP.prefill, TP.decode, max_batch=64, kv_capacity_tokens=150)
    r = simulate_aggregated(_req([0.0, 0.0], 100, 11), small, 1, 64)
    assert r.ttft[1] > 0.08  # the second waits for the first to finish


def test_evaluate_attainment_and_overload() -> None:
    slo = SLO.of(ttft=0.05, tpot=0.02, percentile=90, attainment=0.9)
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

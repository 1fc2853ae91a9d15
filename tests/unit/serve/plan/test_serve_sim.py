"""The discrete-event simulator against closed-form cases."""

from __future__ import annotations

import heapq
from collections import deque

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


# ----------------------------------------------------------------------------- segments vs one step per pass


def _ref_retire(
    running: list[tuple[int, int]], step: int, t: float, finish: list[float], inp: list[int], out: list[int]
) -> tuple[int, int, int]:
    """Finish the requests whose last decode step is ``step`` (at time ``t``); returns how many, and
    the context and KV-cache tokens they release."""
    gone = ctx = kv = 0
    while running and running[0][0] <= step:
        _, k = heapq.heappop(running)
        finish[k] = t
        gone += 1
        ctx += inp[k] + out[k] - 1
        kv += inp[k] + out[k]
    return gone, ctx, kv


def _reference_batch_instance(
    arr: list[float], inp: list[int], out: list[int], tp: TpProfile, max_batch: int, prefill: bool
) -> tuple[list[float], list[float]]:
    """The simulator's batch instance one decode step per pass: the reference for its segments."""
    n = len(arr)
    first = list(arr) if not prefill else [0.0] * n
    finish = [0.0] * n
    cap = tp.kv_capacity_tokens or float("inf")
    budget = tp.prefill_max_tokens
    pa, pb, pc = tp.prefill.a, tp.prefill.b, tp.prefill.c
    da, db, dc = tp.decode.a, tp.decode.b, tp.decode.c
    waiting: deque[int] = deque()
    running: list[tuple[int, int]] = []  # (finish step, index)
    step = 0
    batch = 0
    sum_ctx = 0.0
    reserved = 0.0
    t = 0.0
    nxt = 0
    done = 0
    while done < n:
        while nxt < n and arr[nxt] <= t:
            waiting.append(nxt)
            nxt += 1
        if not waiting and batch == 0:
            t = arr[nxt]
            continue
        admitted: list[int] = []
        sl = sl2 = 0.0
        while waiting and batch + len(admitted) < max_batch:
            k = waiting[0]
            need = inp[k] + out[k]
            if reserved + need > cap and (batch or admitted):
                break
            if prefill and admitted and sl + inp[k] > budget:
                break
            waiting.popleft()
            admitted.append(k)
            reserved += need
            sl += inp[k]
            sl2 += inp[k] * inp[k]
        if prefill and admitted:
            t += (pa + pb * sl + pc * sl2) / 1000.0
            for k in admitted:
                first[k] = t
        for k in admitted:
            if out[k] <= 1:
                finish[k] = first[k]
                reserved -= inp[k] + out[k]
                done += 1
                continue
            heapq.heappush(running, (step + out[k] - 1, k))
            batch += 1
            sum_ctx += inp[k]
        if prefill and admitted or batch == 0:
            continue
        t += (da + db * sum_ctx + dc * batch) / 1000.0
        step += 1
        sum_ctx += batch
        gone, ctx, kv = _ref_retire(running, step, t, finish, inp, out)
        batch -= gone
        done += gone
        sum_ctx -= ctx
        reserved -= kv
    return first, finish


@pytest.mark.parametrize("seed", range(2))
def test_decode_segments_match_one_step_per_pass_to_the_bit(seed: int) -> None:
    """Fast-forwarding decode steps between events gives the same first-token and finish times, to the
    bit, as one pass per step: with and without prefill, full batches, a KV cache that blocks the queue,
    and one-token answers that free room at once."""
    import dataclasses
    import random

    from gpufleet.serve.plan import sim
    from gpufleet.serve.plan.profile import load_profile

    rng = random.Random(seed)
    tps = list(load_profile("opt-13b-a100").tps.values())
    for _ in range(25):
        n = rng.randrange(1, 300)
        rate = rng.choice([0.5, 2.0, 10.0, 50.0])
        arr = sorted(rng.random() * n / rate for _ in range(n))
        inp = [rng.randrange(1, 2000) for _ in range(n)]
        out = [rng.randrange(1, 600) for _ in range(n)]
        tp = rng.choice(tps)
        if rng.random() < 0.5:
            tp = dataclasses.replace(tp, kv_capacity_tokens=rng.choice([500, 3000, 20000]))
        mb = rng.choice([1, 4, 32, 256])
        for prefill in (True, False):
            got = sim._batch_instance(arr, inp, out, tp, mb, prefill)
            assert got == _reference_batch_instance(arr, inp, out, tp, mb, prefill)

"""Discrete-event simulation of continuous batching with queueing, driven by a latency profile.

Each engine instance is simulated on its own (requests reach replicas round-robin, in arrival
order), one event per engine iteration, so the cost is O(iterations + requests·log batch):

* **aggregated** instance (vLLM-like, prefill first, no chunked prefill): when requests wait and
  the running batch has room, the next iteration is a prefill of the waiting requests (FIFO, up to
  ``prefill_max_tokens`` tokens and ``max_batch`` running); its requests get their first token when
  it ends. Otherwise the iteration is one decode step of the whole running batch. Prefills stall
  running decodes: the interference DistServe removes.
* **aggregated with chunked prefill** (vLLM V1 / Sarathi-Serve-like, ``chunk`` > 0): every
  iteration has a budget of ``chunk`` tokens; running decodes take one each, the rest goes to the
  prompts being prefilled, FIFO, a piece at a time. A prompt piece of k tokens after p done costs
  b·k + c·((p+k)² − p²), so the pieces of one prompt add up to its whole prefill; the iteration
  costs the decode step plus its pieces. Decodes never stall for a whole prompt, but every step
  carries some prefill: interference spread thin instead of in bursts.
* **disaggregated**: prefill instances only prefill (FIFO batches); the KV cache then moves to a
  decode instance in ``input_len × kv_bytes_per_token / bandwidth``; decode instances admit
  arrivals at step boundaries and only decode.

A request is admitted only when the batch is below ``max_batch`` and, with a KV capacity, its
whole context (input + output) fits beside the contexts already reserved (no preemption).
Times are seconds. TTFT = first token − arrival; TPOT = (finish − first token)/(output − 1).
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

import numpy as np

from gpufleet.core.errors import ConfigError
from gpufleet.serve.common.slo import SLO
from gpufleet.serve.plan.profile import TpProfile

__all__ = ["Requests", "SimResult", "simulate_aggregated", "simulate_disaggregated", "evaluate"]


@dataclass(frozen=True)
class Requests:
    arrival: np.ndarray  # seconds, sorted
    inp: np.ndarray  # input tokens
    out: np.ndarray  # output tokens


@dataclass(frozen=True)
class SimResult:
    ttft: np.ndarray  # seconds
    tpot: np.ndarray  # seconds (0 for 1-token answers)
    out: np.ndarray
    end: float  # last finish time


def _prefill_instance(arr: list[float], inp: list[int], tp: TpProfile, max_batch: int) -> list[float]:
    """First-token times of a prefill-only instance (FIFO batches)."""
    n = len(arr)
    first = [0.0] * n
    budget = tp.prefill_max_tokens
    t = 0.0
    i = 0
    while i < n:
        if arr[i] > t:
            t = arr[i]
        j, sl, sl2 = i, 0.0, 0.0
        while j < n and arr[j] <= t and j - i < max_batch and (j == i or sl + inp[j] <= budget):
            sl += inp[j]
            sl2 += inp[j] * inp[j]
            j += 1
        t += tp.prefill_ms(sl, sl2) / 1000.0
        for k in range(i, j):
            first[k] = t
        i = j
    return first


def _retire(
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


_SEGMENT = 24  # decode steps from which numpy's one pass beats a Python loop over them


def _decode_segment(
    t: float,
    step: int,
    sum_ctx: float,
    batch: int,
    due: int,
    until: float | None,
    da: float,
    db: float,
    dc: float,
) -> tuple[float, int, float]:
    """``due - step`` decode steps of a batch of ``batch``, stopping early after the first step that ends
    at or after ``until``: (clock, step, context sum) after them. numpy's cumulative sum adds one step
    after another, as the loop in :func:`_batch_instance` does, so the clock is the same to the bit."""
    m = due - step
    ctx = sum_ctx + batch * np.arange(m, dtype=np.float64)
    clock = np.cumsum(np.concatenate(([t], (da + db * ctx + dc * batch) / 1000.0)))[1:]
    if until is not None:
        m = min(m, int(np.searchsorted(clock, until, side="left")) + 1)
    return float(clock[m - 1]), step + m, sum_ctx + batch * m


def _batch_instance(
    arr: list[float], inp: list[int], out: list[int], tp: TpProfile, max_batch: int, prefill: bool
) -> tuple[list[float], list[float]]:
    """(first-token, finish) times of an aggregated instance (``prefill``) or a decode-only one
    (``arr`` = when the KV cache is ready; the first token was made by the prefill instance)."""
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
        # Decode steps until the next retirement is due or, with nobody waiting, a request arrives. Until
        # then no pass of the loop above admits anything (a head of the queue that does not fit stays out
        # until a retirement frees room), so only the clock and the context sum move: the same sums, in
        # the same order, as one pass per step, without the pass.
        due = running[0][0]
        watch = not waiting
        if waiting and batch < max_batch and reserved + inp[waiting[0]] + out[waiting[0]] <= cap:
            due = step + 1  # it fits now (a one-token answer just left): the next pass admits it
        if due - step > _SEGMENT:
            t, step, sum_ctx = _decode_segment(
                t, step, sum_ctx, batch, due, arr[nxt] if watch and nxt < n else None, da, db, dc
            )
        else:
            while True:
                t += (da + db * sum_ctx + dc * batch) / 1000.0
                step += 1
                sum_ctx += batch
                if step >= due or watch and nxt < n and arr[nxt] <= t:
                    break
        gone, ctx, kv = _retire(running, step, t, finish, inp, out)
        batch -= gone
        done += gone
        sum_ctx -= ctx
        reserved -= kv
    return first, finish


def _chunked_instance(
    arr: list[float], inp: list[int], out: list[int], tp: TpProfile, max_batch: int, chunk: int
) -> tuple[list[float], list[float]]:
    """(first-token, finish) times of an aggregated instance with chunked prefill (module doc)."""
    n = len(arr)
    first = [0.0] * n
    finish = [0.0] * n
    cap = tp.kv_capacity_tokens or float("inf")
    pa, pb, pc = tp.prefill.a, tp.prefill.b, tp.prefill.c
    da, db, dc = tp.decode.a, tp.decode.b, tp.decode.c
    waiting: deque[int] = deque()
    filling: deque[list[int]] = deque()  # [index, prompt tokens done], admitted, FIFO
    running: list[tuple[int, int]] = []  # (finish step, index)
    step = batch = nxt = done = 0
    sum_ctx = reserved = t = 0.0
    while done < n:
        while nxt < n and arr[nxt] <= t:
            waiting.append(nxt)
            nxt += 1
        while waiting and batch + len(filling) < max_batch:
            k = waiting[0]
            need = inp[k] + out[k]
            if reserved + need > cap and (batch or filling):
                break
            waiting.popleft()
            filling.append([k, 0])
            reserved += need
        if not filling and batch == 0:
            t = arr[nxt]
            continue
        room = chunk - batch  # decodes first: one token each
        cost = (da + db * sum_ctx + dc * batch) if batch else pa
        finished: list[int] = []
        for item in filling:
            if room <= 0:
                break
            k, p = item
            piece = min(room, inp[k] - p)
            cost += pb * piece + pc * ((p + piece) ** 2 - p * p)
            item[1] = p + piece
            room -= piece
            if item[1] >= inp[k]:
                finished.append(k)
        t += cost / 1000.0
        if batch:
            step += 1
            sum_ctx += batch
            gone, ctx, kv = _retire(running, step, t, finish, inp, out)
            batch -= gone
            done += gone
            sum_ctx -= ctx
            reserved -= kv
        for k in finished:
            filling.popleft()  # pieces go FIFO, so the finished ones lead the queue
            first[k] = t
            if out[k] <= 1:
                finish[k] = t
                reserved -= inp[k] + out[k]
                done += 1
                continue
            heapq.heappush(running, (step + out[k] - 1, k))
            batch += 1
            sum_ctx += inp[k]
    return first, finish


def _split(n: int, parts: int) -> list[np.ndarray]:
    idx = np.arange(n)
    return [idx[r::parts] for r in range(parts)]


def _result(req: Requests, first: np.ndarray, finish: np.ndarray) -> SimResult:
    out = req.out
    tpot = np.where(out > 1, (finish - first) / np.maximum(out - 1, 1), 0.0)
    return SimResult(first - req.arrival, tpot, out, float(finish.max()) if len(finish) else 0.0)


def simulate_aggregated(
    req: Requests, tp: TpProfile, replicas: int, max_batch: int, chunk: int = 0
) -> SimResult:
    """Aggregated replicas; ``chunk`` > 0: chunked prefill with that token budget per iteration."""
    n = len(req.arrival)
    first = np.zeros(n)
    finish = np.zeros(n)
    for idx in _split(n, replicas):
        a, i, o = req.arrival[idx].tolist(), req.inp[idx].tolist(), req.out[idx].tolist()
        if chunk > 0:
            f, e = _chunked_instance(a, i, o, tp, max_batch, chunk)
        else:
            f, e = _batch_instance(a, i, o, tp, max_batch, prefill=True)
        first[idx] = f
        finish[idx] = e
    return _result(req, first, finish)


def simulate_disaggregated(
    req: Requests,
    ptp: TpProfile,
    p_replicas: int,
    p_batch: int,
    dtp: TpProfile,
    d_replicas: int,
    d_batch: int,
    kv_bytes_per_token: float,
    kv_gbps: float,
) -> SimResult:
    n = len(req.arrival)
    first = np.zeros(n)
    for idx in _split(n, p_replicas):
        first[idx] = _prefill_instance(req.arrival[idx].tolist(), req.inp[idx].tolist(), ptp, p_batch)
    xfer = req.inp * kv_bytes_per_token / (kv_gbps * 1e9) if kv_gbps > 0 and kv_bytes_per_token > 0 else 0.0
    ready = first + xfer
    order = np.argsort(ready, kind="stable")
    finish = np.zeros(n)
    for part in _split(n, d_replicas):
        idx = order[part]
        _, e = _batch_instance(
            ready[idx].tolist(), req.inp[idx].tolist(), req.out[idx].tolist(), dtp, d_batch, prefill=False
        )
        finish[idx] = e
    return _result(req, first, finish)


def evaluate(res: SimResult, slo: SLO, warmup: float = 0.05) -> dict[str, object]:
    """Attainment (share of measured requests meeting every limit), percentiles, pass/fail.
    Every limit is judged at its percentile (a plain limit at p90, :meth:`SLO.percentile`).
    The first ``warmup`` share of requests is left out; the last third must also attain the target
    (a growing queue fails even when the early requests were fast)."""
    if "e2e" in slo.limits:
        raise ConfigError("the simulator judges ttft and tpot; an e2e limit cannot be planned for")
    n = len(res.ttft)
    lo = int(n * warmup)
    ttft, tpot = res.ttft[lo:], res.tpot[lo:]
    ok = np.ones(len(ttft), dtype=bool)
    pct_ok = True
    pcts: dict[str, dict[str, float]] = {}
    qs = sorted({50.0, 90.0, 99.0, *(slo.percentile(m) for m in slo.limits)})
    for name, arr in (("ttft", ttft), ("tpot", tpot[res.out[lo:] > 1] if np.any(res.out[lo:] > 1) else tpot)):
        pcts[name] = {f"p{q:g}": float(np.percentile(arr, q)) * 1000.0 for q in qs}
        if name in slo.limits:
            limit, q = slo.limits[name].seconds, slo.percentile(name)  # type: ignore[index, arg-type]
            full = ttft if name == "ttft" else tpot
            ok &= full <= limit
            pct_ok &= float(np.percentile(arr, q)) <= limit
    att = float(ok.mean()) if len(ok) else 0.0
    tail = ok[-max(1, len(ok) // 3) :]
    passed = bool(pct_ok and att >= slo.attainment and float(tail.mean()) >= slo.attainment)
    slack = min(
        (
            1.0 - float(np.percentile(ttft if m == "ttft" else tpot, slo.percentile(m))) / lim.seconds
            for m, lim in slo.limits.items()
        ),
        default=0.0,
    )
    return {
        "attainment": att,
        "passed": passed,
        "ttft_ms": pcts["ttft"],
        "tpot_ms": pcts["tpot"],
        "slack": slack,
    }

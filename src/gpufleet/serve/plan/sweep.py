"""Profiling a live server: a ``serve bench`` sweep that yields the points
:mod:`gpufleet.serve.plan.profile` fits (prefill TTFT per input length, decode TPOT per batch and context),
and whether the server batches at all."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["measure", "overlap_share", "SERIAL_OVERLAP"]


def _level(url: str, model: str, spec: str, concurrency: int, requests: int, out: Path | None) -> list[Any]:
    """One closed-loop level through the ``serve bench`` library; the successful records."""
    from gpufleet.serve.bench.client import ClientConfig, endpoint_url
    from gpufleet.serve.bench.levels import BenchOptions, run_level
    from gpufleet.serve.bench.runner import LoadPlan
    from gpufleet.serve.common.slo import SLO
    from gpufleet.serve.common.workload import parse_spec

    plan = LoadPlan(
        ClientConfig(endpoint_url(url, "chat"), model),
        parse_spec(spec),
        concurrency=concurrency,
        requests=requests + 1,
        warmup_requests=1,
    )
    if out is None:
        from gpufleet.serve.bench.runner import run_load

        res = run_load(plan)
    else:
        d = out / f"c{concurrency}-{spec.replace(';', '_').replace(':', '').replace('=', '')}"
        res, _ = run_level(plan, BenchOptions(SLO(), d, 1e9, plots=False), out=d)
    return [r for r in res.records if r.ok and not r.warmup and r.ttft_s is not None]


SERIAL_OVERLAP = 0.1  # below this share of overlapping generation time, requests run one at a time


def overlap_share(recs: list[Any]) -> float:
    """Share of the generation time (first token to last) of ``recs`` that overlaps another's.

    Judged by order, not speed, so CPU contention cannot flip it: a server that runs one request
    at a time never streams two at once (about 0), while a batching one at concurrency 2 overlaps
    for about half of the summed time."""
    spans = sorted(
        (r.sent_s + r.ttft_s, r.sent_s + r.e2e_s)
        for r in recs
        if r.ttft_s is not None and r.e2e_s is not None and r.e2e_s > r.ttft_s
    )
    total = sum(b - a for a, b in spans)
    if total <= 0:
        return 0.0
    union, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            union += b - max(a, end)
            end = b
    return 1.0 - union / total


def measure(
    url: str,
    model: str,
    *,
    inputs: list[int],
    decode_inputs: list[int],
    output: int,
    concurrency: list[int],
    requests: int,
    out: Path | None = None,
    log: Any = None,
) -> tuple[list[tuple[float, float, float]], list[tuple[float, float, float]], int]:
    """Sweep a live server: prefill points (concurrency 1, ``out=2``, TTFT per input length) and
    decode points (TPOT at each concurrency and context). Returns (prefill, decode, max_batch):
    a server whose generations at concurrency 2 do not overlap in time serves one request at a
    time (llama.cpp): max_batch = 1 and each TPOT is a batch-1 step."""
    say = log or (lambda _m: None)
    pre: list[tuple[float, float, float]] = []
    for n in inputs:
        recs = _level(url, model, f"in=fixed:{n};out=fixed:2", 1, requests, out)
        pre += [(float(n), float(n * n), r.ttft_s * 1000.0) for r in recs]
        say(
            f"prefill L={n}: {len(recs)} requests, median TTFT "
            f"{float(np.median([r.ttft_s for r in recs]) * 1000) if recs else float('nan'):.1f} ms"
        )
    dec: list[tuple[float, float, float]] = []
    max_batch = max(concurrency)
    overlap = 0.0
    for c in sorted(concurrency):
        for n in decode_inputs:
            recs = [
                r
                for r in _level(url, model, f"in=fixed:{n};out=fixed:{output}", c, requests * c, out)
                if r.tpot_s is not None
            ]
            if not recs:
                continue
            if c == 2:
                overlap = max(overlap, overlap_share(recs))
            batch = 1 if max_batch == 1 else c
            dec += [(float(batch * (n + output / 2)), float(batch), r.tpot_s * 1000.0) for r in recs]
            say(
                f"decode c={c} L={n}: {len(recs)} requests, median TPOT "
                f"{float(np.median([r.tpot_s for r in recs]) * 1000):.2f} ms"
            )
        if c == 2 and overlap < SERIAL_OVERLAP:
            say(
                "the server serves one request at a time (at concurrency 2 only "
                f"{overlap:.0%} of generation time overlaps): max_batch = 1"
            )
            max_batch = 1
            dec = [p for p in dec if p[1] == 1.0] + [(p[0] / p[1], 1.0, p[2]) for p in dec if p[1] == 2.0]
            break
    return pre, dec, max_batch

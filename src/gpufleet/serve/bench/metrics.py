"""Metrics of one load level, from request records. Formulas (also in docs/serve-bench.md):

* TTFT = first non-empty content chunk − sent (includes queueing in the server);
* TPOT = (e2e − TTFT) / (output tokens − 1), per request with ≥ 2 output tokens;
* ITL = every gap between consecutive non-empty content chunks, pooled over requests;
* e2e = end of stream − sent;
* send lag = sent − intended;
* duration = last end − first intended send (measured requests only);
* request throughput = successful requests / duration; output token throughput = their tokens / duration;
* attainment = requests meeting every SLO / ALL measured requests (failed requests count as misses);
* goodput = requests meeting every SLO / duration (benchmark-style goodput at this load; the max rate
  at which attainment ≥ target, DistServe's goodput, is what ``--find-max-rate`` reports).

Warm-up requests are sent but left out of every metric.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from gpufleet.serve.bench.client import TOKEN_SOURCES, RequestRecord
from gpufleet.serve.common.slo import SLO

__all__ = ["percentiles", "summarize_records", "PCTS", "TOKEN_SOURCE_ORDER", "DEFAULT_MAX_LAG_MS"]

PCTS = (50, 90, 95, 99)
TOKEN_SOURCE_ORDER = TOKEN_SOURCES  # most to least exact
DEFAULT_MAX_LAG_MS = 5.0
MIN_SEND_RATE_RATIO = 0.95


def _q(sorted_xs: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default method) of sorted data."""
    if len(sorted_xs) == 1:
        return sorted_xs[0]
    pos = (len(sorted_xs) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    a, b = sorted_xs[lo], sorted_xs[hi]
    return a if pos == lo or a == b else a + (b - a) * (pos - lo)  # (b - a) would be nan for inf, inf


def percentiles(xs: Sequence[float], scale: float = 1000.0) -> dict[str, float | int | None]:
    """count, mean, p50/p90/p95/p99, min, max of ``xs`` times ``scale`` (seconds → ms by default)."""
    if not xs:
        return {"count": 0, "mean": None, **{f"p{p}": None for p in PCTS}, "min": None, "max": None}
    s = sorted(xs)
    out: dict[str, float | int | None] = {"count": len(s), "mean": sum(s) / len(s) * scale}
    for p in PCTS:
        out[f"p{p}"] = _q(s, p / 100) * scale
    out["min"], out["max"] = s[0] * scale, s[-1] * scale
    return out


def _slo_percentiles(recs: Sequence[RequestRecord], slo: SLO) -> dict[str, float | None]:
    """``{"ttft_p90": seconds}`` for each percentile limit, over every measured request; a failed
    request (or one without that measurement) counts as infinitely slow. None: no requests."""
    out: dict[str, float | None] = {}
    for m, lim in slo.limits.items():
        if lim.percentile is not None:
            vals = sorted(v if r.ok and (v := getattr(r, f"{m}_s")) is not None else math.inf for r in recs)
            out[lim.key(m)] = _q(vals, lim.percentile / 100) if vals else None
    return out


def summarize_records(
    records: Sequence[RequestRecord],
    slo: SLO,
    *,
    offered_rate: float | None = None,
    max_lag_ms: float = DEFAULT_MAX_LAG_MS,
    open_loop: bool = True,
) -> dict[str, Any]:
    """The metrics block of summary.json for the non-warm-up records."""
    recs = [r for r in records if not r.warmup]
    ok = [r for r in recs if r.ok]
    n = len(recs)
    if recs:
        start = min(r.intended_s for r in recs)
        end = max(r.sent_s + (r.e2e_s or 0.0) for r in recs)
        duration = max(end - start, 1e-9)
    else:
        duration = 0.0
    good = [r for r in ok if slo.met(r.ttft_s, r.tpot_s, r.e2e_s)]
    pct = _slo_percentiles(recs, slo)
    out_tokens = sum(r.output_tokens or 0 for r in ok)
    in_tokens = sum(r.prompt_tokens or r.input_tokens_asked for r in ok)
    errors = Counter(r.error for r in recs if r.error)
    sources = Counter(r.token_source for r in ok if r.token_source)
    worst = next((s for s in reversed(TOKEN_SOURCE_ORDER) if sources.get(s)), "none")

    lags = [r.lag_s for r in recs if r.sent_s or r.e2e_s is not None]
    sends = sorted(r.sent_s for r in recs if r.e2e_s is not None)
    intended = sorted(r.intended_s for r in recs)
    achieved_send = (
        (len(sends) - 1) / (sends[-1] - sends[0]) if len(sends) > 1 and sends[-1] > sends[0] else None
    )
    sched_rate = (
        (len(intended) - 1) / (intended[-1] - intended[0])
        if len(intended) > 1 and intended[-1] > intended[0]
        else None
    )
    lag = percentiles(lags)
    invalid: list[str] = []
    if open_loop and lag["p99"] is not None and float(lag["p99"]) > max_lag_ms:  # type: ignore[arg-type]
        invalid.append(f"p99 send lag {lag['p99']:.2f} ms > {max_lag_ms:g} ms: the client could not keep up")
    if open_loop and achieved_send and sched_rate and achieved_send < MIN_SEND_RATE_RATIO * sched_rate:
        invalid.append(
            f"achieved send rate {achieved_send:.1f}/s < {MIN_SEND_RATE_RATIO:.0%} "
            f"of scheduled {sched_rate:.1f}/s"
        )
    itl = [g for r in ok for g in r.itl_s]
    return {
        "requests": {
            "measured": n,
            "ok": len(ok),
            "failed": n - len(ok),
            "good": len(good),
            "warmup": len(records) - n,
        },
        "errors": dict(sorted(errors.items())),
        "duration_s": duration,
        "rate": {
            "offered_per_s": offered_rate,
            "scheduled_per_s": sched_rate,
            "achieved_send_per_s": achieved_send,
            "request_throughput_per_s": len(ok) / duration if duration else 0.0,
        },
        "tokens": {
            "source": worst,
            "sources": dict(sources),
            "output_total": out_tokens,
            "input_total": in_tokens,
            "output_throughput_per_s": out_tokens / duration if duration else 0.0,
            "total_throughput_per_s": (out_tokens + in_tokens) / duration if duration else 0.0,
            "output_per_request": percentiles([float(r.output_tokens or 0) for r in ok], 1.0),
        },
        "latency_ms": {
            "ttft": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
            "tpot": percentiles([t for r in ok if (t := r.tpot_s) is not None]),
            "itl": percentiles(itl),
            "e2e": percentiles([r.e2e_s for r in ok if r.e2e_s is not None]),
        },
        "slo": {
            "limits_ms": {k: v * 1000 for k, v in slo.as_dict().items()},
            # None: no requests, or too many failed for the percentile to be finite
            "percentiles_ms": {k: None if v is None or math.isinf(v) else v * 1000 for k, v in pct.items()},
            "percentiles_met": all(
                v is not None and v <= slo.limits[k.partition("_")[0]].seconds  # type: ignore[index]
                for k, v in pct.items()
            ),
            "attainment": len(good) / n if n else 0.0,
            "goodput_per_s": len(good) / duration if duration else 0.0,
            "goodput_kind": "requests meeting every SLO per second at this load (benchmark-style)",
        },
        "client": {
            "send_lag_ms": lag,
            "max_lag_ms": max_lag_ms,
            "valid": not invalid,
            "invalid_reasons": invalid,
        },
    }

"""Find the highest request rate whose SLO attainment stays at or above a target.

Doubling from a start rate until a level fails, then bisection between the best passing and the
first failing rate until they are within ``rel_tol``; then a stability check re-runs the best rate
and steps down if the re-run fails. A level passes when attainment ≥ target, the client kept up
(send lag and achieved rate valid), the queue did not grow during the level (see
:func:`queue_growing`) and requests completed as fast as they were sent (:func:`falling_behind`:
a short level can otherwise finish its burst inside the SLO while the server is saturated).
The result is DistServe's goodput of the deployment: max rate at attainment.

Pure logic: ``measure(rate)`` is given by the caller (a real load level, or a synthetic function in
tests).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from gpufleet.serve.bench.client import RequestRecord

__all__ = ["Level", "SearchResult", "search_max_rate", "queue_growing", "falling_behind"]


@dataclass
class Level:
    """The outcome of one load level."""

    rate: float
    attainment: float
    client_valid: bool = True
    stable: bool = True
    summary: dict[str, Any] = field(default_factory=dict)
    recheck: bool = False
    percentiles_met: bool = True  # every percentile limit of the SLO (ttft_p90=...) held

    def passes(self, target: float) -> bool:
        return self.client_valid and self.stable and self.percentiles_met and self.attainment >= target


LimitedBy = Literal["slo", "client", "max_rate", "min_rate", "max_levels", "interrupted"]
"""What stopped the search (``interrupted`` is set by the caller on Ctrl-C)."""


@dataclass
class SearchResult:
    max_rate: float  # 0.0 when no level passed
    target: float
    levels: list[Level]
    limited_by: LimitedBy
    stable: bool  # the stability re-run of max_rate passed


def queue_growing(records: Sequence[RequestRecord], factor: float = 2.0, floor_s: float = 0.05) -> bool:
    """True when the median TTFT of the last third of the level exceeds ``factor`` × the first
    third's + ``floor_s``: the server (or client) fell behind and requests queue up."""
    recs = sorted((r for r in records if not r.warmup and r.ttft_s is not None), key=lambda r: r.intended_s)
    if len(recs) < 9:
        return False
    k = len(recs) // 3

    def med(rs: Sequence[RequestRecord]) -> float:
        xs = sorted(r.ttft_s or 0.0 for r in rs)
        return xs[len(xs) // 2]

    return med(recs[-k:]) > factor * med(recs[:k]) + floor_s


def falling_behind(records: Sequence[RequestRecord], factor: float = 0.8) -> bool:
    """True when requests completed markedly slower than they were sent (completion rate below
    ``factor`` × send rate): the server's throughput is below the offered load, however few requests
    the level had. Rates are (n − 1) / span of the send and completion times."""
    sends = sorted(r.sent_s for r in records if not r.warmup and r.sent_s)
    done = sorted(r.sent_s + r.e2e_s for r in records if not r.warmup and r.ok and r.e2e_s is not None)
    if len(sends) < 4 or len(done) < 4 or sends[-1] <= sends[0] or done[-1] <= done[0]:
        return False
    send_rate = (len(sends) - 1) / (sends[-1] - sends[0])
    done_rate = (len(done) - 1) / (done[-1] - done[0])
    return done_rate < factor * send_rate


def search_max_rate(
    measure: Callable[[float], Level],
    target: float,
    start_rate: float,
    *,
    max_rate: float | None = None,
    rel_tol: float = 0.05,
    max_levels: int = 16,
    min_rate: float | None = None,
) -> SearchResult:
    """Doubling, then bisection, then a stability re-run of the best rate (see module doc)."""
    if not 0 < target <= 1:
        raise ValueError("target attainment must be in (0, 1]")
    levels: list[Level] = []
    floor = min_rate if min_rate is not None else start_rate / 64

    def run(rate: float, recheck: bool = False) -> Level:
        lv = measure(rate)
        lv.recheck = recheck
        levels.append(lv)
        return lv

    lo: float | None = None
    hi: float | None = None
    limited: LimitedBy = "slo"
    rate = start_rate if max_rate is None else min(start_rate, max_rate)
    while len(levels) < max_levels:  # doubling (or halving while nothing passed yet)
        lv = run(rate)
        if lv.passes(target):
            lo = rate
            if hi is not None:
                break
            if max_rate is not None and rate >= max_rate:
                limited = "max_rate"
                break
            rate = rate * 2 if max_rate is None else min(rate * 2, max_rate)
        else:
            hi = rate
            if not lv.client_valid:
                limited = "client"
            if lo is not None:
                break
            rate /= 2
            if rate < floor:
                return SearchResult(0.0, target, levels, "min_rate", False)
    while lo is not None and hi is not None and hi / lo - 1 > rel_tol and len(levels) < max_levels:
        mid = (lo + hi) / 2
        lv = run(mid)
        if lv.passes(target):
            lo = mid
        else:
            hi = mid
            limited = "client" if not lv.client_valid else "slo"
    if len(levels) >= max_levels and limited not in ("max_rate",):
        limited = "max_levels" if lo is None or hi is None or hi / lo - 1 > rel_tol else limited
    stable = False
    for _ in range(2):  # stability: re-run the best rate; on failure step down to the next passing one
        if lo is None:
            break
        if run(lo, recheck=True).passes(target):
            stable = True
            break
        hi = lo
        lower = [lv.rate for lv in levels if not lv.recheck and lv.passes(target) and lv.rate < lo]
        lo = max(lower) if lower else None
    return SearchResult(lo if lo is not None else 0.0, target, levels, limited, stable)

"""How fast can this client send? ``max_sustainable_rate`` against the null endpoint.

A rate is sustained when, over a level of ``duration_s``, p99 send lag ≤ ``lag_p99_ms``, the achieved
send rate is ≥ 95% of the scheduled one and no request failed. The search is the same
doubling-then-bisection as find-max-rate. ``--calibrate`` stores the result per process count in
``~/.cache/gpufleet/serve-calibration.json`` (``GPUFLEET_CACHE_DIR`` overrides the folder); later runs
flag offered rates above it.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from gpufleet.core.env import Env
from gpufleet.serve.bench.arrivals import parse_arrival
from gpufleet.serve.bench.client import ClientConfig, endpoint_url
from gpufleet.serve.bench.findmax import Level, search_max_rate
from gpufleet.serve.bench.metrics import summarize_records
from gpufleet.serve.bench.runner import LoadPlan, run_load
from gpufleet.serve.common.slo import SLO
from gpufleet.serve.common.workload import parse_spec

__all__ = ["max_sustainable_rate", "calibrate", "cached_capacity", "cache_path"]


def max_sustainable_rate(
    url: str,
    processes: int = 1,
    lag_p99_ms: float = 2.0,
    *,
    duration_s: float = 3.0,
    start_rate: float = 250.0,
    max_rate: float | None = 100_000.0,
    rel_tol: float = 0.05,
    arrival: str = "poisson",
    workload: str = "in=fixed:8;out=fixed:2",
    api: str = "chat",
    model: str = "null",
    seed: int = 0,
) -> dict[str, Any]:
    """The highest request rate ``processes`` client processes sustain against ``url``.

    Returns ``{"max_rate", "lag_p99_ms_limit", "processes", "levels": [{"rate", "sustained",
    "send_lag_p99_ms", "achieved_send_rate", "failed"}...], "limited_by", "stable"}``.
    """
    cfg = ClientConfig(endpoint_url(url, api), model, api, timeout_s=30.0)
    base = LoadPlan(
        cfg,
        parse_spec(workload, seed),
        arrival=parse_arrival(arrival),
        duration_s=duration_s,
        seed=seed,
        processes=processes,
    )
    levels: list[dict[str, Any]] = []

    def measure(rate: float) -> Level:
        res = run_load(replace(base, rate=rate))
        m = summarize_records(res.records, SLO(), offered_rate=rate, max_lag_ms=lag_p99_ms)
        ok = m["client"]["valid"] and m["requests"]["failed"] == 0 and not res.interrupted
        levels.append(
            {
                "rate": rate,
                "sustained": ok,
                "send_lag_p99_ms": m["client"]["send_lag_ms"]["p99"],
                "send_lag_p50_ms": m["client"]["send_lag_ms"]["p50"],
                "achieved_send_rate": m["rate"]["achieved_send_per_s"],
                "failed": m["requests"]["failed"],
                "errors": m["errors"],
            }
        )
        return Level(rate, 1.0 if ok else 0.0, client_valid=True, stable=True)

    r = search_max_rate(measure, 1.0, start_rate, max_rate=max_rate, rel_tol=rel_tol, max_levels=14)
    return {
        "max_rate": r.max_rate,
        "lag_p99_ms_limit": lag_p99_ms,
        "processes": processes,
        "duration_s": duration_s,
        "arrival": arrival,
        "workload": workload,
        "stable": r.stable,
        "limited_by": r.limited_by,
        "levels": levels,
    }


def cache_path() -> Path:
    root = Env.CACHE_DIR.get() or os.path.join(os.path.expanduser("~"), ".cache", "gpufleet")
    return Path(root) / "serve-calibration.json"


def cached_capacity(processes: int) -> float | None:
    try:
        data = json.loads(cache_path().read_text())
        return float(data[str(processes)]["max_rate"]) or None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def calibrate(
    processes: int = 1, lag_p99_ms: float = 2.0, duration_s: float = 3.0, null_workers: int = 1
) -> dict[str, Any]:
    """Start the null endpoint, measure, store the result in the cache, return it."""
    from gpufleet.serve.bench.null_endpoint import start_null_endpoint

    with start_null_endpoint(workers=null_workers) as ne:
        res = max_sustainable_rate(ne.url, processes, lag_p99_ms, duration_s=duration_s)
    res["measured_unix"] = time.time()
    res["null_workers"] = null_workers
    p = cache_path()
    try:
        data = json.loads(p.read_text()) if p.is_file() else {}
    except (OSError, ValueError):
        data = {}
    data[str(processes)] = {k: v for k, v in res.items() if k != "levels"}
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(data, indent=2))
    except OSError:
        pass  # a read-only home: the result is still returned and written to --out
    return res

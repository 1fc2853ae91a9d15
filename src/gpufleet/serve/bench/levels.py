"""Orchestration of ``gpufleet serve bench``: one load level, or a find-max-rate search.

Writes into ``out``: ``summary.json``, ``requests.csv``, ``latency_cdf.png``; with find-max-rate also
``capacity.json``, ``capacity.png`` and ``levels/NN-<rate>/`` per level. Results are written also
after Ctrl-C (``interrupted: true``).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gpufleet.serve.bench.findmax import Level, falling_behind, queue_growing, search_max_rate
from gpufleet.serve.bench.metrics import summarize_records
from gpufleet.serve.bench.output import (
    CAPACITY_VERSION,
    SUMMARY_VERSION,
    plot_capacity,
    plot_cdfs,
    write_csv,
    write_json,
)
from gpufleet.serve.bench.runner import LoadPlan, LoadResult, Progress, run_load
from gpufleet.serve.common.slo import SLO

__all__ = ["BenchOptions", "detect_model", "run_level", "find_max", "level_summary"]


@dataclass(frozen=True)
class BenchOptions:
    slo: SLO
    out: Path
    max_lag_ms: float
    client_capacity: float | None = None  # from --calibrate or the cache
    plots: bool = True


def detect_model(base_url: str, timeout_s: float = 5.0) -> tuple[str | None, str | None]:
    """(first model id from GET /v1/models, None) or (None, why it could not be read)."""
    u = base_url.rstrip("/")
    for suffix in ("/chat/completions", "/completions"):
        if u.endswith(suffix):
            u = u[: -len(suffix)]
    if not u.endswith("/v1"):
        u += "/v1"
    try:
        with urllib.request.urlopen(u + "/models", timeout=timeout_s) as resp:
            data = json.loads(resp.read())
        return str(data["data"][0]["id"]), None
    except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError, TypeError) as e:
        reason = getattr(e, "reason", e)
        return None, f"{type(e).__name__}: {reason}"


def level_summary(plan: LoadPlan, res: LoadResult, opts: BenchOptions) -> dict[str, Any]:
    m = summarize_records(
        res.records,
        opts.slo,
        offered_rate=plan.rate,
        max_lag_ms=opts.max_lag_ms,
        open_loop=not plan.concurrency,
    )
    growing = queue_growing(res.records)
    behind = bool(plan.rate and not plan.concurrency and falling_behind(res.records))
    flags = []
    if opts.client_capacity and plan.rate and plan.rate > opts.client_capacity:
        flags.append(
            f"offered rate {plan.rate:g}/s is above this client's calibrated capacity "
            f"{opts.client_capacity:.0f}/s"
        )
    if m["tokens"]["source"] == "estimate":
        flags.append(
            "output token counts are ESTIMATES (4 chars/token): the server sent no usage; "
            "pass --tokenizer PATH for exact counts"
        )
    return {
        "schema": "gpufleet.serve.summary",
        "version": SUMMARY_VERSION,
        "created_unix": time.time(),
        "started_unix": res.started_unix,
        "valid": m["client"]["valid"]
        and not (opts.client_capacity and plan.rate and plan.rate > opts.client_capacity),
        "interrupted": res.interrupted,
        "flags": flags,
        "target": {"url": plan.client.url, "model": plan.client.model, "api": plan.client.api},
        "load": {
            "mode": "concurrency" if plan.concurrency else "rate",
            "rate": plan.rate,
            "arrival": None if plan.concurrency else str(plan.arrival),
            "concurrency": plan.concurrency,
            "requests": plan.requests,
            "duration_s": plan.duration_s,
            "warmup_requests": plan.warmup_requests,
            "warmup_s": plan.warmup_s,
            "processes": res.processes,
            "seed": plan.seed,
            "planned": res.planned,
            "sent": sum(1 for r in res.records if r.e2e_s is not None and r.error != "interrupted"),
        },
        "workload": plan.workload.describe(),
        "queue_growing": growing,
        "falling_behind": behind,
        **m,
    }


def _write_level(out: Path, plan: LoadPlan, res: LoadResult, s: dict[str, Any], plots: bool) -> None:
    write_json(out / "summary.json", s)
    write_csv(out / "requests.csv", res.records)
    if (
        plots
        and plot_cdfs(
            out / "latency_cdf.png",
            res.records,
            title=f"{plan.client.model} @ {plan.rate or plan.concurrency}",
        )
        is None
    ):
        s["flags"].append("plots skipped: matplotlib is not installed (pip install 'gpufleet[plot]')")
        write_json(out / "summary.json", s)


def run_level(
    plan: LoadPlan,
    opts: BenchOptions,
    out: Path | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    stop: Any = None,
) -> tuple[LoadResult, dict[str, Any]]:
    """Run one load level, summarize it and write its files into ``out`` (default ``opts.out``)."""
    res = run_load(plan, on_progress=on_progress, stop=stop)
    s = level_summary(plan, res, opts)
    _write_level(out or opts.out, plan, res, s, opts.plots)
    return res, s


def _point(s: dict[str, Any], recheck: bool) -> dict[str, Any]:
    lat = {k: {p: v[p] for p in ("mean", "p50", "p90", "p99")} for k, v in s["latency_ms"].items()}
    return {
        "offered_rate": s["load"]["rate"],
        "achieved_rate": s["rate"]["request_throughput_per_s"],
        "achieved_send_rate": s["rate"]["achieved_send_per_s"],
        "attainment": s["slo"]["attainment"],
        "goodput_per_s": s["slo"]["goodput_per_s"],
        "output_tokens_per_s": s["tokens"]["output_throughput_per_s"],
        "requests": s["requests"],
        "errors": s["errors"],
        "latency_ms": lat,
        "send_lag_p99_ms": s["client"]["send_lag_ms"]["p99"],
        "client_valid": s["client"]["valid"],
        "queue_growing": s["queue_growing"],
        "recheck": recheck,
    }


def find_max(
    plan: LoadPlan,
    opts: BenchOptions,
    target: float,
    *,
    start_rate: float,
    max_rate: float | None,
    rel_tol: float = 0.05,
    on_level: Callable[[float], Callable[[Progress], None] | None] | None = None,
    stop: Any = None,
) -> dict[str, Any]:
    """Search the max rate at ``target`` attainment; writes capacity.json (+ png) and each level."""
    n = [0]
    interrupted = [False]
    cap: dict[str, Any] = {}

    def measure(rate: float) -> Level:
        if interrupted[0]:
            return Level(rate, 0.0, client_valid=False, stable=False)
        n[0] += 1
        lp = replace(plan, rate=rate)
        res, s = run_level(
            lp,
            opts,
            out=opts.out / "levels" / f"{n[0]:02d}-{rate:.3g}",
            on_progress=on_level(rate) if on_level else None,
            stop=stop,
        )
        interrupted[0] = res.interrupted
        steady = not (s["queue_growing"] or s["falling_behind"])
        lv = Level(
            rate,
            s["slo"]["attainment"],
            client_valid=s["valid"],
            stable=steady,
            summary=s,
            percentiles_met=s["slo"]["percentiles_met"],
        )
        return lv

    def capacity(levels: list[Level], result: Any) -> dict[str, Any]:
        return {
            "schema": "gpufleet.serve.capacity",
            "version": CAPACITY_VERSION,
            "created_unix": time.time(),
            "target": {"url": plan.client.url, "model": plan.client.model, "api": plan.client.api},
            "workload": plan.workload.describe(),
            "arrival": str(plan.arrival),
            "slo_ms": {k: v * 1000 for k, v in opts.slo.as_dict().items()},
            "slo": str(opts.slo),
            "target_attainment": target,
            "max_rate": result.max_rate if result else None,
            "stable": result.stable if result else False,
            "limited_by": result.limited_by if result else "interrupted",
            "interrupted": interrupted[0],
            "client_capacity": opts.client_capacity,
            "points": [_point(lv.summary, lv.recheck) for lv in levels if lv.summary],
        }

    result = search_max_rate(measure, target, start_rate, max_rate=max_rate, rel_tol=rel_tol)
    if interrupted[0]:
        result.limited_by = "interrupted"
    cap = capacity(result.levels, result)
    write_json(opts.out / "capacity.json", cap)
    if opts.plots:
        plot_capacity(opts.out / "capacity.png", cap)
    best = [lv for lv in result.levels if lv.summary and lv.rate == result.max_rate]
    if best:  # the top-level summary.json is the best level's
        write_json(opts.out / "summary.json", best[-1].summary)
    return cap

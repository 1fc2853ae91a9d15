"""``gpufleet serve bench``: the SLA benchmark (docs/serve-bench.md).

``register(app)`` adds the command to the ``serve`` group. Thin: parses and validates flags (every
bad value is a one-line UsageError), then calls :mod:`gpufleet.serve.bench`. aiohttp, Rich live and
matplotlib load inside the command.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from gpufleet.core.errors import UsageError
from gpufleet.core.exitcodes import ExitCode

__all__ = ["register", "bench"]


Opt = typer.Option


def register(app: typer.Typer) -> None:
    app.command("bench")(bench)


def _seconds(text: str, what: str) -> float:
    """A bare number of seconds or a duration with a unit; > 0."""
    from gpufleet.core.units import parse_duration

    return parse_duration(text, what, allow_zero=False)


def _warmup(text: str | None) -> tuple[int, float]:
    if not text:
        return 0, 0.0
    if text.isdigit():
        return int(text), 0.0
    return 0, _seconds(text, "--warmup")


def bench(
    url: Annotated[
        str | None, Opt("--url", help="Server base URL (http://host:port, .../v1) or the full endpoint.")
    ] = None,
    model: Annotated[
        str | None, Opt("--model", help="Model name (default: first of GET /v1/models).")
    ] = None,
    api: Annotated[str, Opt("--api", help="chat | completions")] = "chat",
    workload: Annotated[
        str,
        Opt(
            "--workload",
            help="Spec (in=lognormal:512,0.5;out=fixed:128;prefix=4:256), "
            "preset (chat, reasoning, short) or Mooncake trace .jsonl.",
        ),
    ] = "chat",
    rate: Annotated[
        float | None, Opt("--rate", help="Requests/s, open loop (start rate of --find-max-rate).")
    ] = None,
    arrival: Annotated[str, Opt("--arrival", help="poisson | constant | gamma:<shape>")] = "poisson",
    concurrency: Annotated[int | None, Opt("--concurrency", help="Closed loop: this many users.")] = None,
    requests: Annotated[int | None, Opt("--requests", help="Requests per level (default 100).")] = None,
    duration: Annotated[str | None, Opt("--duration", help="Seconds per level (e.g. 60 or 2m).")] = None,
    warmup: Annotated[
        str | None,
        Opt("--warmup", help="First N requests, or first D seconds (5s), sent but left out of the metrics."),
    ] = None,
    slo: Annotated[
        str | None,
        Opt("--slo", help="e.g. ttft=500ms,tpot=50ms,e2e=10s; ttft_p90=500ms also checks the p90."),
    ] = None,
    out: Annotated[Path, Opt("--out", help="Output folder.")] = Path("serve-bench"),
    find_max_rate: Annotated[
        bool, Opt("--find-max-rate", help="Search the max rate at --attainment.")
    ] = False,
    attainment: Annotated[
        float, Opt("--attainment", help="Target SLO attainment for --find-max-rate.")
    ] = 0.9,
    max_rate: Annotated[float | None, Opt("--max-rate", help="Upper bound of the rate search.")] = None,
    calibrate: Annotated[
        bool,
        Opt(
            "--calibrate",
            help="Measure this client's max rate on the null endpoint first; refuse rates above it.",
        ),
    ] = False,
    tokenizer: Annotated[
        str | None,
        Opt("--tokenizer", help="Local tokenizer path for token counts when the server sends no usage."),
    ] = None,
    processes: Annotated[int, Opt("--processes", help="Client processes.")] = 1,
    seed: Annotated[int, Opt("--seed", help="Seed of arrivals and prompts.")] = 0,
    timeout: Annotated[str, Opt("--timeout", help="Per-request timeout (e.g. 600 or 30s).")] = "600",
    max_lag_ms: Annotated[float, Opt("--max-lag-ms", help="Run invalid above this p99 send lag.")] = 5.0,
    exact_output: Annotated[
        bool, Opt("--exact-output/--no-exact-output", help="Send min_tokens and ignore_eos too.")
    ] = True,
    progress: Annotated[
        bool | None, Opt("--progress/--no-progress", help="Live view (default: on a TTY).")
    ] = None,
    no_plot: Annotated[bool, Opt("--no-plot", help="Do not write PNG plots.")] = False,
    json_out: Annotated[bool, Opt("--json", help="Print summary.json (or capacity.json) to stdout.")] = False,
) -> int:
    """Benchmark an OpenAI-compatible streaming endpoint against latency SLOs (docs/serve-bench.md)."""
    import json
    import math

    from rich.console import Console

    # ---- validate everything before any work
    from gpufleet.core.paths import output_dir
    from gpufleet.serve.bench.arrivals import parse_arrival
    from gpufleet.serve.bench.client import APIS
    from gpufleet.serve.common.slo import parse_slo
    from gpufleet.serve.common.workload import load_workload

    if api not in APIS:
        raise UsageError(f"--api must be chat or completions (got {api!r})")
    if rate is not None and (not math.isfinite(rate) or rate <= 0):
        raise UsageError(f"--rate must be > 0 (got {rate:g})")
    if concurrency is not None and concurrency < 1:
        raise UsageError(f"--concurrency must be >= 1 (got {concurrency})")
    if rate is not None and concurrency is not None:
        raise UsageError("give --rate (open loop) or --concurrency (closed loop), not both")
    if requests is not None and duration is not None:
        raise UsageError("give --requests or --duration, not both")
    if requests is not None and requests < 1:
        raise UsageError(f"--requests must be >= 1 (got {requests})")
    if processes < 1 or processes > 256:
        raise UsageError(f"--processes must be in 1..256 (got {processes})")
    if not 0 < attainment <= 1:
        raise UsageError(f"--attainment must be in (0, 1] (got {attainment:g})")
    if max_rate is not None and not max_rate > 0:
        raise UsageError(f"--max-rate must be > 0 (got {max_rate:g})")
    if not max_lag_ms > 0:
        raise UsageError("--max-lag-ms must be > 0")
    if find_max_rate and concurrency is not None:
        raise UsageError("--find-max-rate searches a request rate; it does not combine with --concurrency")
    duration_s = _seconds(duration, "--duration") if duration is not None else None
    timeout_s = _seconds(timeout, "--timeout")
    warm_n, warm_s = _warmup(warmup)
    slo_v = parse_slo(slo, attainment=attainment)
    arr = parse_arrival(arrival)
    wl = load_workload(workload, seed)
    if tokenizer:
        from gpufleet.serve.bench.tokens import load_tokenizer

        load_tokenizer(tokenizer)  # fail early, in one line
    if url is None and not calibrate:
        raise UsageError("--url is required (or use --calibrate alone)")
    if url is not None and not url.startswith(("http://", "https://")):
        raise UsageError(f"--url must start with http:// or https:// (got {url!r})")
    open_ended = rate is None and concurrency is None and not hasattr(wl, "entries")
    if url is not None and open_ended and not find_max_rate:
        raise UsageError("give --rate R (open loop) or --concurrency C (closed loop)")
    output_dir(out, "--out")
    err = Console(stderr=True)
    show = sys.stderr.isatty() if progress is None else progress

    from gpufleet.serve.bench.calibrate import cached_capacity
    from gpufleet.serve.bench.calibrate import calibrate as run_calibration

    capacity = cached_capacity(processes)
    if calibrate:
        err.print(f"calibrating the client ({processes} process(es)) against the null endpoint ...")
        cal = run_calibration(processes)
        capacity = cal["max_rate"] or None
        out.mkdir(parents=True, exist_ok=True)
        (out / "calibration.json").write_text(json.dumps(cal, indent=2))
        err.print(
            f"client capacity: {cal['max_rate']:.0f} req/s at p99 send lag <= {cal['lag_p99_ms_limit']} ms"
        )
        if url is None:
            if json_out:
                typer.echo(json.dumps(cal, indent=2))
            return 0
        if rate is not None and capacity and rate > capacity and not find_max_rate:
            raise UsageError(
                f"--rate {rate:g}/s is above this client's calibrated capacity "
                f"{capacity:.0f}/s; use more --processes"
            )
    assert url is not None  # checked above: only --calibrate alone runs without one

    from gpufleet.serve.bench.client import ClientConfig, endpoint_url
    from gpufleet.serve.bench.levels import BenchOptions, detect_model, find_max, run_level
    from gpufleet.serve.bench.live import LiveView, summary_table
    from gpufleet.serve.bench.runner import LoadPlan

    if model is None:
        model, why = detect_model(url)
        if model is None:
            err.print(f"[yellow]warning:[/] could not list models at {url} ({why}); using model 'default'")
            model = "default"
    cfg = ClientConfig(endpoint_url(url, api), model, api, timeout_s=timeout_s, exact_output=exact_output)
    if open_ended:  # --find-max-rate searches from 1 req/s
        rate = 1.0
    if requests is None and duration_s is None and not hasattr(wl, "entries"):
        requests = 100
    plan = LoadPlan(
        cfg,
        wl,
        rate=rate,
        arrival=arr,
        concurrency=concurrency,
        requests=requests,
        duration_s=duration_s,
        warmup_requests=warm_n,
        warmup_s=warm_s,
        seed=seed,
        processes=processes,
        tokenizer=tokenizer,
    )
    opts = BenchOptions(slo_v, out, max_lag_ms, capacity, plots=not no_plot)
    out.mkdir(parents=True, exist_ok=True)

    if find_max_rate:
        assert rate is not None
        views: list[LiveView] = []

        def on_level(r: float) -> object:
            for v in views:
                v.__exit__()
            views.clear()
            err.print(f"level: {r:.3g} req/s")
            v = LiveView(f"find-max-rate @ {r:.3g} req/s", err, enabled=show).__enter__()
            views.append(v)
            return v.update

        try:
            cap = find_max(
                plan, opts, attainment, start_rate=rate, max_rate=max_rate or capacity, on_level=on_level
            )  # type: ignore[arg-type]
        finally:
            for v in views:
                v.__exit__()
        if json_out:
            typer.echo(json.dumps(cap, indent=2))
        err.print(
            f"max rate at {attainment:.0%} attainment: [bold]{cap['max_rate']:.3g}[/] req/s "
            f"(limited by {cap['limited_by']}, stable={cap['stable']}); {out / 'capacity.json'}"
        )
        if cap["interrupted"]:
            err.print("interrupted: partial results written")
            return ExitCode.INTERRUPTED
        return 0

    with LiveView(f"serve bench → {url}", err, enabled=show) as view:
        res, s = run_level(plan, opts, on_progress=view.update)
    if json_out:
        typer.echo(json.dumps(s, indent=2))
    else:
        Console().print(summary_table(s))
    for f in s["flags"]:
        err.print(f"[yellow]note:[/] {f}")
    for reason in s["client"]["invalid_reasons"]:
        err.print(f"[red]INVALID RUN:[/] {reason}")
    err.print(f"results: {out}/summary.json, requests.csv" + ("" if no_plot else ", latency_cdf.png"))
    if res.interrupted:
        err.print("interrupted: partial results written")
        return ExitCode.INTERRUPTED
    if s["requests"]["measured"] and s["requests"]["ok"] == 0:
        errs = ", ".join(f"{k}: {v}" for k, v in s["errors"].items())
        print(
            f"gpufleet: error: all {s['requests']['measured']} requests failed ({errs}); "
            f"is the server at {url} up?",
            file=sys.stderr,
        )
        return ExitCode.FAILED
    return 0

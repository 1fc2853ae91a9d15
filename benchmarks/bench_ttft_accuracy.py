"""The client's TTFT / ITL / TPOT measurement error against `gpufleet serve mock`'s configured truth.

For each configuration the mock runs in its own process with jitter 0 (every delay exact), and
`serve bench`'s load loop (gpufleet.serve.bench.runner.run_load, one client process) sends a fixed
workload at a constant rate well inside the mock's capacity (no queueing). Error = measured p50 -
configured value; the table shows the median over --repeats runs, and the worst p99 error. The
mock never answers early, so a positive error is what the client (and the OS) adds.

    .venv/bin/python benchmarks/bench_ttft_accuracy.py [--repeats 5] [--requests 40]

Writes benchmarks/results/serve_ttft_accuracy.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/support: MockProcess

from gpufleet.serve.bench.arrivals import parse_arrival  # noqa: E402
from gpufleet.serve.bench.client import ClientConfig, endpoint_url  # noqa: E402
from gpufleet.serve.bench.metrics import summarize_records  # noqa: E402
from gpufleet.serve.bench.runner import LoadPlan, run_load  # noqa: E402
from gpufleet.serve.common.slo import SLO  # noqa: E402
from gpufleet.serve.common.workload import parse_spec  # noqa: E402
from support.llama import MockProcess  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# (ttft ms, itl ms, output tokens, rate req/s): a chat-like default, a fast one, a slow-decode one.
CONFIGS = [(200.0, 20.0, 16, 4.0), (50.0, 5.0, 32, 8.0), (500.0, 50.0, 8, 2.0)]


def one_run(
    url: str, ttft: float, itl: float, out_tokens: int, rate: float, requests: int, seed: int
) -> dict[str, Any]:
    cfg = ClientConfig(endpoint_url(url, "chat"), "mock", "chat", timeout_s=60.0)
    plan = LoadPlan(cfg, parse_spec(f"in=fixed:64;out=fixed:{out_tokens}", seed), rate=rate,
                    arrival=parse_arrival("constant"), requests=requests, seed=seed)  # fmt: skip
    res = run_load(plan)
    m = summarize_records(res.records, SLO(), offered_rate=rate, max_lag_ms=5.0)
    lat = m["latency_ms"]
    assert m["requests"]["failed"] == 0, m["errors"]
    return {
        "ttft_err_p50_ms": lat["ttft"]["p50"] - ttft,
        "ttft_err_p99_ms": lat["ttft"]["p99"] - ttft,
        "itl_err_p50_ms": lat["itl"]["p50"] - itl,
        "itl_err_p99_ms": lat["itl"]["p99"] - itl,
        "tpot_err_p50_ms": lat["tpot"]["p50"] - itl,
        "send_lag_p99_ms": m["client"]["send_lag_ms"]["p99"],
        "token_source": m["tokens"]["source"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--out", type=Path, default=RESULTS / "serve_ttft_accuracy.json")
    a = ap.parse_args()
    rows: list[dict[str, Any]] = []
    print(f"{'ttft/itl (ms)':>14} {'out':>4} {'TTFT err p50':>13} {'p99':>7} {'ITL err p50':>12} {'p99':>7}"
          f" {'TPOT err p50':>13}")  # fmt: skip
    for ttft, itl, n, rate in CONFIGS:
        args = ["--ttft", f"{ttft}ms", "--itl", f"{itl}ms", "--jitter", "0", "--max-batch", "256"]
        with MockProcess(args) as m:
            runs = [one_run(m.url, ttft, itl, n, rate, a.requests, seed) for seed in range(a.repeats)]
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k.endswith("_ms")}
        worst = {k + "_worst": max(r[k] for r in runs) for k in ("ttft_err_p99_ms", "itl_err_p99_ms")}
        row = {"ttft_ms": ttft, "itl_ms": itl, "output_tokens": n, "rate": rate, "median": med, **worst,
               "token_source": runs[0]["token_source"], "runs": runs}  # fmt: skip
        rows.append(row)
        print(
            f"{ttft:>7g}/{itl:<6g} {n:>4} {med['ttft_err_p50_ms']:>+13.2f} {med['ttft_err_p99_ms']:>+7.2f}"
            f" {med['itl_err_p50_ms']:>+12.2f} {med['itl_err_p99_ms']:>+7.2f}"
            f" {med['tpot_err_p50_ms']:>+13.2f}"
        )
    result = {
        "benchmark": "serve_ttft_accuracy",
        "what": "client-measured minus configured (mock, jitter 0); median over repeats",
        "repeats": a.repeats, "requests_per_run": a.requests,
        "host": {"python": platform.python_version(), "cpus": os.cpu_count(), "load1": os.getloadavg()[0]},
        "measured_unix": time.time(),
        "configs": rows,
    }  # fmt: skip
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()

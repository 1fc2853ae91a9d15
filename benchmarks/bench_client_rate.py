"""P6 (client side): the request rate one client process sustains against the null endpoint.

Sustained = p99 send lag <= 2 ms, achieved send rate >= 95% of scheduled, no failed request, over a
level of --duration seconds (Poisson arrivals, 8-token prompts, 2 output tokens). Searched with
doubling then bisection; median of --repeats searches. Writes benchmarks/results/p6_client.json.

    .venv/bin/python benchmarks/bench_client_rate.py [--repeats 3] [--duration 3] [--loop uvloop|asyncio]
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from gpufleet.serve.bench.calibrate import max_sustainable_rate  # noqa: E402
from gpufleet.serve.bench.null_endpoint import start_null_endpoint  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--duration", type=float, default=3.0)
    ap.add_argument("--processes", type=int, default=1)
    ap.add_argument("--lag-ms", type=float, default=2.0)
    ap.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    ap.add_argument("--null-workers", type=int, default=1)
    ap.add_argument("--out", type=Path, default=RESULTS / "p6_client.json")
    a = ap.parse_args()
    os.environ["GPUFLEET_SERVE_LOOP"] = a.loop
    runs = []
    with start_null_endpoint(workers=a.null_workers) as ne:
        for i in range(a.repeats):
            r = max_sustainable_rate(ne.url, a.processes, a.lag_ms, duration_s=a.duration)
            print(f"repeat {i + 1}: {r['max_rate']:.0f} req/s (limited by {r['limited_by']})", flush=True)
            runs.append(r)
    rates = [r["max_rate"] for r in runs]
    result = {
        "benchmark": "p6_client_rate",
        "tool": "gpufleet serve bench",
        "median_max_rate": statistics.median(rates),
        "rates": rates,
        "lag_p99_ms_limit": a.lag_ms,
        "processes": a.processes,
        "loop": a.loop,
        "duration_s": a.duration,
        "null_workers": a.null_workers,
        "host": {
            "cpus": os.cpu_count(),
            "loadavg_1m_at_end": os.getloadavg()[0],
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "measured_unix": time.time(),
        "runs": runs,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2))
    print(
        f"median sustained rate: {result['median_max_rate']:.0f} req/s  (p99 lag <= {a.lag_ms} ms, "
        f"{a.processes} process, {a.loop}; load avg {result['host']['loadavg_1m_at_end']:.1f}) -> {a.out}"
    )


if __name__ == "__main__":
    main()

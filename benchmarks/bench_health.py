"""Health pillar benchmarks: the quick tier's wall time, and detection by the relative (node-peer) check.

1. **Quick tier wall time**: ``gpufleet health check --plan quick`` as a subprocess (process start and
   the torch import included), median of ``--repeats`` (goal <= 30 s). Writes results/health_quick.json.
2. **Detection**: the relative check's matmul measurement with one device (here: one CPU core lane)
   made 20% slower through ``GPUFLEET_HEALTH_INJECT_SLOW`` (the environment the check reads, i.e. the
   process boundary), ``--runs`` times, and ``--runs`` clean runs. Goal: caught in every slowed run, no
   false positive in the clean runs. Writes results/health_detection.json.

    .venv/bin/python benchmarks/bench_health.py [--repeats 3] [--runs 20] [--slowdown 0.2] [--samples 100]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
RESULTS = Path(__file__).resolve().parent / "results"


def host() -> dict[str, object]:
    return {"cpus": os.cpu_count(), "python": platform.python_version(), "loadavg_1m": os.getloadavg()[0]}


def write(name: str, payload: dict[str, object]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / name
    out.write_text(json.dumps({"host": host(), "time": time.time(), **payload}, indent=1) + "\n")
    return out


def bench_quick(repeats: int) -> dict[str, object]:
    walls, inner, statuses = [], [], []
    with tempfile.TemporaryDirectory() as fleet:
        env = {**os.environ, "GPUFLEET_FLEET_DIR": fleet}
        for _ in range(repeats):
            t0 = time.perf_counter()
            p = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "gpufleet.cli.main",
                    "health",
                    "check",
                    "--plan",
                    "quick",
                    "--json",
                    "--no-record",
                ],
                capture_output=True,
                text=True,
                env=env,
                timeout=120,
            )
            walls.append(time.perf_counter() - t0)
            rep = json.loads(p.stdout)
            inner.append(rep["duration_s"])
            statuses.append(rep["status"])
    res = {
        "repeats": repeats,
        "wall_s": walls,
        "median_wall_s": statistics.median(walls),
        "median_checks_s": statistics.median(inner),
        "statuses": statuses,
        "goal_s": 30.0,
        "meets_goal": statistics.median(walls) <= 30.0,
    }
    print(
        f"quick tier: median wall {res['median_wall_s']:.2f} s (checks {res['median_checks_s']:.2f} s) "
        f"over {repeats} runs; statuses {statuses}; goal <= 30 s"
    )
    return res


def bench_detection(runs: int, slowdown: float, samples: int) -> dict[str, object]:
    from gpufleet.health.checks.measure import INJECT_ENV
    from gpufleet.health.plans import parse_plan
    from gpufleet.health.profiles import get_profile
    from gpufleet.health.results import Status
    from gpufleet.health.runner import run_plan

    plan = parse_plan(
        {
            "name": "detect",
            "budget_s": 60,
            "checks": [{"name": "compute.matmul", "params": {"samples": samples, "cpu_devices": 2}}],
        },
        "bench",
    )
    profile = get_profile("CPU")
    probe = run_plan(plan, profile).results
    lanes = [r.device for r in probe]
    if len(lanes) < 2:
        raise SystemExit(f"need >= 2 CPU cores for the node-peer rule (lanes: {lanes})")
    caught, false_pos, clean_gaps, slow_gaps, secs = 0, 0, [], [], []
    for i in range(runs):
        target = lanes[i % len(lanes)]  # alternate which lane is slowed
        env = {**os.environ, INJECT_ENV: f"compute.matmul:{target}={slowdown}"}
        t0 = time.perf_counter()
        rep = run_plan(plan, profile, env=env)
        secs.append(time.perf_counter() - t0)
        failed = {r.device for r in rep.results if r.status is Status.FAIL}
        caught += failed == {target}
        vals = {r.device: r.value for r in rep.results}
        slow_gaps.append(1 - vals[target] / max(vals.values()))
        env = {k: v for k, v in os.environ.items() if k != INJECT_ENV}
        rep = run_plan(plan, profile, env=env)
        false_pos += any(r.status is Status.FAIL for r in rep.results)
        vals = {r.device: r.value for r in rep.results}
        clean_gaps.append(1 - min(vals.values()) / max(vals.values()))
    res = {
        "runs": runs,
        "slowdown": slowdown,
        "samples": samples,
        "peer_tol": profile.peer_tol,
        "lanes": lanes,
        "caught": caught,
        "false_positives": false_pos,
        "slowed_gap_min": min(slow_gaps),
        "slowed_gap_median": statistics.median(slow_gaps),
        "clean_gap_max": max(clean_gaps),
        "clean_gap_median": statistics.median(clean_gaps),
        "seconds_per_run_median": statistics.median(secs),
        "meets_goal": caught == runs and false_pos == 0,
    }
    print(
        f"detection: {slowdown:.0%} slower lane caught in {caught}/{runs} runs; false positives "
        f"{false_pos}/{runs} clean runs (tolerance {profile.peer_tol:.0%}; gap slowed min "
        f"{res['slowed_gap_min']:.1%}, clean max {res['clean_gap_max']:.1%}; "
        f"{res['seconds_per_run_median']:.2f} s per run)"
    )
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--slowdown", type=float, default=0.2)
    ap.add_argument("--samples", type=int, default=100)
    args = ap.parse_args()
    print(f"loadavg {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print("->", write("health_quick.json", bench_quick(args.repeats)))
    print("->", write("health_detection.json", bench_detection(args.runs, args.slowdown, args.samples)))


if __name__ == "__main__":
    main()

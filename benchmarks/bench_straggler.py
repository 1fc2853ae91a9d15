# ruff: noqa: E501
"""Straggler detection: false positives on clean runs, and a 20%-slow rank caught.

``gpufleet run -n 2`` of the P3 MLP script (benchmarks/scripts/mttr_gpufleet.py, DDP, no crash), as a
user runs it (no thread pinning, standby interpreters on):

* ``clean``: N runs as they are. Every ``straggler`` event is a false positive.
* ``slow``: N runs with rank 1 slowed by the ``slow`` drill: it sleeps ``delay`` before every step's
  forward, ``delay`` = 20% of the median clean step time measured first, i.e. a rank whose steps take
  1.2x its peer's on its own. Caught = a ``straggler`` event for rank 1; the step it was flagged at is
  the detection latency in steps (the rank is slow from step 0). A flag on rank 0 is a false positive.

The two kinds alternate (clean, slow, clean, ...) so machine noise hits both alike.
``python benchmarks/bench_straggler.py [--runs 20]``; JSON to benchmarks/results/straggler.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "scripts" / "mttr_gpufleet.py"
BIN = Path(sys.executable).parent


def one_run(work: Path, args: argparse.Namespace, delay: float | None) -> dict[str, Any]:
    from gpufleet.core.ledger import read_events

    cmd = [str(BIN / "gpufleet"), "run", "-n", "2", "--run-dir", str(work), "--no-progress",
           "--checkpoint-every", "1000"]  # fmt: skip
    if delay is not None:
        cmd += ["--inject", f"slow:rank=1,delay={delay:.4f}"]
    cmd += ["--", sys.executable, str(SCRIPT), "--steps", str(args.steps), "--width", str(args.width)]
    env = {**os.environ, "BENCH_OUT": str(work / "out")}
    env.pop("OMP_NUM_THREADS", None)
    t0 = time.time()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    events = read_events(work)
    steps = [e for e in events if e["ev"] == "step"]
    flags = [{"rank": e["rank"], "step": e["step"], "section": e["section"], "ratio": e["ratio"]}
             for e in events if e["ev"] == "straggler"]  # fmt: skip
    return {
        "rc": p.returncode,
        "wall_s": round(time.time() - t0, 2),
        "delay_s": delay,
        "step_median_s": statistics.median(e["dt"] for e in steps[5:]) if len(steps) > 5 else None,
        "flags": flags,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=20, help="runs of each kind")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--width", type=int, default=1024, help="MLP width (1024: a step of ~50-100 ms here)")
    ap.add_argument("--slow", type=float, default=0.2, help="rank 1's extra time, as a share of a clean step")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--out", default=str(HERE / "results" / "straggler.json"))
    args = ap.parse_args()
    load0 = os.getloadavg()
    root = Path(tempfile.mkdtemp(prefix="straggler_"))
    # The delay is 20% of a clean step, measured on this host first.
    probe = one_run(root / "probe", args, None)
    if probe["rc"] != 0 or probe["step_median_s"] is None:
        print(f"probe run failed: {probe}", file=sys.stderr)
        return 1
    delay = args.slow * probe["step_median_s"]
    print(
        f"clean step {probe['step_median_s'] * 1000:.1f} ms -> slow drill {delay * 1000:.1f} ms per step",
        file=sys.stderr,
    )
    clean: list[dict[str, Any]] = []
    slow: list[dict[str, Any]] = []
    for i in range(args.runs):
        for kind, out in (("clean", clean), ("slow", slow)):
            r = one_run(root / f"{kind}-{i}", args, delay if kind == "slow" else None)
            out.append(r)
            print(
                f"  {kind} {i:2d}: rc {r['rc']} step {r['step_median_s'] or 0:.3f}s flags {r['flags']}",
                file=sys.stderr,
            )
    false_pos = sum(1 for r in clean if r["flags"]) + sum(
        1 for r in slow if any(f["rank"] != 1 for f in r["flags"])
    )
    caught = [r for r in slow if any(f["rank"] == 1 for f in r["flags"])]
    latency = [min(f["step"] for f in r["flags"] if f["rank"] == 1) for r in caught]
    res = {
        "benchmark": "straggler_detection",
        "goal": "no false positive on 20 clean runs; a 20%-slow rank caught 20/20 within a stated number of steps",
        "config": {
            "runs": args.runs,
            "steps": args.steps,
            "width": args.width,
            "slow_share": args.slow,
            "delay_s": delay,
            "probe_step_s": probe["step_median_s"],
            "rule": "train/straggler.py StragglerConfig defaults",
        },  # fmt: skip
        "clean_runs_with_flags": sum(1 for r in clean if r["flags"]),
        "false_positives": false_pos,
        "caught": f"{len(caught)}/{len(slow)}",
        "flag_step_median": statistics.median(latency) if latency else None,
        "flag_step_max": max(latency) if latency else None,
        "failed_runs": sum(1 for r in clean + slow if r["rc"] != 0),
        "machine": {"cpus": os.cpu_count(), "load_avg_start": load0, "load_avg_end": os.getloadavg()},
        "clean": clean,
        "slow": slow,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(f"false positives {false_pos} (clean runs flagged: {res['clean_runs_with_flags']}/{len(clean)}); "
          f"caught {res['caught']}, flagged at step median {res['flag_step_median']} max {res['flag_step_max']}")  # fmt: skip
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

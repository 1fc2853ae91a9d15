"""Short job: what ``gpufleet run -n 2`` adds to torchrun's wall time and CPU on a job of a few seconds.

The script is P9's GRU language model (benchmarks/scripts/p9_gru.py, no checkpoints): the same
training as plain PyTorch under ``torchrun --standalone --nproc-per-node 2`` and through the run API
under ``gpufleet run -n 2`` (standby interpreters on, the default) and ``gpufleet run -n 2
--no-standby``. The three launchers are interleaved across repeats (the order rotates each repeat), so
the machine's noise hits them alike.

Per trial: the launcher's wall time, from spawn to exit, and the CPU seconds of the whole process tree
(the launcher, its ranks and standbys: ``wait4``'s rusage of the launcher, which holds every
descendant it reaped), and three phases of the wall time on rank 0's monotonic clock: start-up (spawn
to the end of the first step), steps (first to last step) and exit (last step to the launcher's exit).
Ratios are gpufleet / torchrun of the medians over repeats. Goal: <= 1.3x torchrun's wall time at 60
steps.

``python benchmarks/bench_short_job.py [--repeats 5] [--steps 60]``; JSON to
benchmarks/results/short_job.json. The load average is recorded before each trial.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "scripts" / "p9_gru.py"
RESULTS = HERE / "results"
BIN = Path(sys.executable).parent
LAUNCHERS = ("torchrun", "gpufleet", "gpufleet-no-standby")
GOAL = 1.3


def _command(launcher: str, work: Path, steps: int) -> list[str]:
    script = ["--steps", str(steps), "--ckpt-every", "0"]
    if launcher == "torchrun":
        return [
            str(BIN / "torchrun"),
            "--standalone",
            "--nproc-per-node",
            "2",
            str(SCRIPT),
            "--launcher",
            "torchrun",
            *script,
        ]
    extra = ["--no-standby"] if launcher == "gpufleet-no-standby" else []
    return [
        str(BIN / "gpufleet"),
        "run",
        "-n",
        "2",
        "--run-dir",
        str(work / "run"),
        "--no-progress",
        *extra,
        "--",
        sys.executable,
        str(SCRIPT),
        "--launcher",
        "gpufleet",
        *script,
    ]


def one_trial(launcher: str, args: argparse.Namespace, root: Path, i: int) -> dict[str, Any]:
    work = root / f"{launcher}-{i}"
    work.mkdir(parents=True)
    env = {**os.environ, "BENCH_OUT": str(work / "out")}
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    p = subprocess.Popen(
        _command(launcher, work, args.steps),
        env=env,
        cwd=work,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    assert p.stderr is not None
    deadline = t0 + args.timeout
    while True:  # wait4 instead of Popen.wait: the rusage of the launcher and every process it reaped
        pid, status, usage = os.wait4(p.pid, os.WNOHANG)
        if pid:
            break
        if time.perf_counter() > deadline:
            os.killpg(p.pid, signal.SIGKILL)
            raise SystemExit(f"bench_short_job: {launcher} ran past {args.timeout} s")
        time.sleep(0.005)
    t1 = time.perf_counter()
    p.returncode = os.waitstatus_to_exitcode(status)
    err = p.stderr.read().decode(errors="replace")
    p.stderr.close()
    result = work / "out" / "steps.json"
    if p.returncode != 0 or not result.exists():
        raise SystemExit(f"bench_short_job: {launcher} failed (exit {p.returncode}):\n{err[-3000:]}")
    ends = json.loads(result.read_text())["ends"]  # rank 0's perf_counter: the same clock as ours
    return {
        "launcher": launcher,
        "repeat": i,
        "load1": round(load, 2),
        "wall_s": round(t1 - t0, 3),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 3),
        "startup_s": round(ends[0] - t0, 3),
        "steps_s": round(ends[-1] - ends[0], 3),
        "exit_s": round(t1 - ends[-1], 3),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds per trial")
    ap.add_argument(
        "--launchers", default=",".join(LAUNCHERS), help="comma-separated, of: " + ",".join(LAUNCHERS)
    )
    ap.add_argument("--out", default=str(RESULTS / "short_job.json"))
    args = ap.parse_args()
    launchers = [x for x in args.launchers.split(",") if x]
    bad = [x for x in launchers if x not in LAUNCHERS]
    if bad or args.repeats < 1 or args.steps < 2:
        print(f"bench_short_job: bad --launchers {bad}, --repeats or --steps", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="gpufleet-short-"))
    rows: list[dict[str, Any]] = []
    try:
        for i in range(args.repeats):
            order = launchers[i % len(launchers) :] + launchers[: i % len(launchers)]
            for launcher in order:
                row = one_trial(launcher, args, root, i)
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    keys = ("wall_s", "cpu_s", "startup_s", "steps_s", "exit_s")
    agg = {
        name: {k: statistics.median(r[k] for r in rows if r["launcher"] == name) for k in keys}
        for name in launchers
    }
    print(
        f"\nmedians over {args.repeats} repeats, {args.steps} steps; load {min(r['load1'] for r in rows)}"
        f"-{max(r['load1'] for r in rows)}"
    )
    print(f"{'launcher':22}" + "".join(f"{k:>11}" for k in keys) + "   wall ratio  cpu ratio")
    base = agg.get("torchrun")
    ratios: dict[str, dict[str, float]] = {}
    for name in launchers:
        line = f"{name:22}" + "".join(f"{agg[name][k]:11.2f}" for k in keys)
        if base and name != "torchrun":
            ratios[name] = {
                "wall": agg[name]["wall_s"] / base["wall_s"],
                "cpu": agg[name]["cpu_s"] / base["cpu_s"],
            }
            line += f"   {ratios[name]['wall']:9.2f}x {ratios[name]['cpu']:9.2f}x"
        print(line)
    if "gpufleet" in ratios:
        met = ratios["gpufleet"]["wall"] <= GOAL
        wall = ratios["gpufleet"]["wall"]
        print(f"gpufleet / torchrun wall: {wall:.2f}x (goal <= {GOAL}x: {'met' if met else 'missed'})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "benchmark": "short job: gpufleet run -n 2 vs torchrun, wall and CPU",
                "host": {"cpus": len(os.sched_getaffinity(0)), "python": platform.python_version()},
                "args": vars(args),
                "medians": agg,
                "ratios": ratios,
                "trials": rows,
            },
            indent=1,
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

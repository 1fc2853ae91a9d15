# ruff: noqa: E501
"""P9 worker defaults: steady-state step time of ``gpufleet run -n 2`` against ``torchrun --nproc-per-node 2``.

The script (benchmarks/scripts/p9_gru.py) is a GRU language model (benchmarks/scripts/gru_lm.py) and does **not** pin
its threads: each launcher's defaults decide (torchrun sets ``OMP_NUM_THREADS=1``; gpufleet sets each
worker's share of the CPUs). Four variants, interleaved across repeats (the order rotates each
repeat) so machine noise hits them alike:

* ``gpufleet``, ``torchrun``: no checkpoints;
* ``gpufleet+ckpt``, ``torchrun+ckpt``: a checkpoint every ``--ckpt-every`` steps (gpufleet's engine;
  for torchrun a synchronous ``torch.distributed.checkpoint.save``, as the DCP tutorial does);
* with ``--with-all-threads``, also ``gpufleet/all-threads``: ``OMP_NUM_THREADS`` exported as the CPU
  count, i.e. torch's own default, which a launcher that sets no thread count leaves each worker.

Steady-state step time: rank 0's wall time per step after ``--warmup`` steps (start-up, restore and
the first steps excluded), as the mean (what throughput sees, checkpoint stalls included) and the
median. Ratios are gpufleet / torchrun of the medians over repeats of those means. Goal: <= 1.05
without checkpoints, <= 1.15 with them.

The run API's own per-step cost is measured apart (``--micro`` steps under ``gpufleet run -n 2``):
a bare ``dist.all_reduce`` of the 4-value control vector, an empty ``run.steps`` iteration (which
does that all-reduce), and one with ``run.log(loss=...)`` (the spike/NaN guard too).

``python benchmarks/bench_p9_threads.py [--repeats 3] [--steps 100]``; JSON to
benchmarks/results/p9_threads.json. The load average is recorded before each trial: on a shared
machine it says how much to trust the figures.
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
VARIANTS = ("gpufleet", "torchrun", "gpufleet+ckpt", "torchrun+ckpt")
ALL_THREADS = "gpufleet/all-threads"
GOALS = {"none": 1.05, "ckpt": 1.15}
THREAD_VARS = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
)


def _env(out: Path, variant: str = "") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}  # the launcher's defaults decide
    env["BENCH_OUT"] = str(out)
    if variant == ALL_THREADS:
        env["OMP_NUM_THREADS"] = str(len(os.sched_getaffinity(0)))
    return env


def _command(variant: str, work: Path, args: argparse.Namespace, extra: list[str]) -> list[str]:
    ckpt = str(args.ckpt_every) if variant.endswith("+ckpt") else "0"
    if variant.startswith("gpufleet"):
        return [
            str(BIN / "gpufleet"),
            "run",
            "-n",
            "2",
            "--run-dir",
            str(work / "run"),
            "--no-progress",
            "--",
            sys.executable,
            str(SCRIPT),
            "--launcher",
            "gpufleet",
            "--ckpt-every",
            ckpt,
            *extra,
        ]
    return [
        str(BIN / "torchrun"),
        "--standalone",
        "--nproc-per-node",
        "2",
        str(SCRIPT),
        "--launcher",
        "torchrun",
        "--ckpt-every",
        ckpt,
        *extra,
    ]


def steady(ends: list[float], warmup: int) -> dict[str, float]:
    dts = [b - a for a, b in zip(ends[warmup:], ends[warmup + 1 :], strict=False)]
    return {
        "mean_s": (ends[-1] - ends[warmup]) / len(dts),
        "median_s": statistics.median(dts),
        "steps": len(dts),
    }


def one_trial(variant: str, args: argparse.Namespace, root: Path, i: int) -> dict[str, Any]:
    work = root / f"{variant.replace('+', '-')}-{i}"
    work.mkdir(parents=True)
    load = os.getloadavg()
    cmd = _command(variant, work, args, ["--steps", str(args.steps)])
    t0 = time.monotonic()
    rc, stderr, hung = _run(cmd, _env(work / "out", variant), work, args.timeout)
    wall = time.monotonic() - t0
    result = work / "out" / "steps.json"
    if (rc != 0 and not hung) or not result.exists():
        raise SystemExit(f"bench_p9: {variant} failed (exit {rc}):\n{stderr[-3000:]}")
    got = json.loads(result.read_text())
    row = {
        "variant": variant,
        "repeat": i,
        "wall_s": round(wall, 2),
        "load1": round(load[0], 2),
        "hung_at_exit": hung,
        "threads": got["threads"],
        "omp": got["omp"],
        **steady(got["ends"], args.warmup),
    }
    if "cpu" in got:  # rank 0's CPU seconds per steady-state step: steadier than wall time on a loaded host
        cpu = got["cpu"]
        row["cpu_mean_s"] = (cpu[-1] - cpu[args.warmup]) / (len(cpu) - 1 - args.warmup)
    if variant.startswith("gpufleet"):
        dts = [e["dt"] for e in _ledger(work / "run") if e.get("ev") == "step" and e["step"] >= args.warmup]
        row["ledger_dt_median_s"] = statistics.median(dts) if dts else None
    notes = [ln for ln in stderr.splitlines() if "OMP_NUM_THREADS" in ln]
    row["launcher_note"] = notes[0].strip()[-200:] if notes else None
    return row


def _run(cmd: list[str], env: dict[str, str], cwd: Path, timeout: float) -> tuple[int, str, bool]:
    """(exit code, stderr, hung): a launcher still running after ``timeout`` is killed with its workers.

    torchrun's gloo workers sometimes never leave ``destroy_process_group`` after the last step; the
    steps they timed are on disk by then, so such a trial counts, marked ``hung_at_exit``.
    """
    with subprocess.Popen(
        cmd,
        env=env,
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as p:
        try:
            _, err = p.communicate(timeout=timeout)
            return p.returncode, err, False
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            _, err = p.communicate()
            return p.returncode, err, True


def _ledger(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "ledger.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def micro(args: argparse.Namespace, root: Path) -> dict[str, float]:
    work = root / "micro"
    work.mkdir()
    cmd = _command("gpufleet", work, args, ["--micro", str(args.micro)])
    rc, stderr, _ = _run(cmd, _env(work / "out"), work, args.timeout)
    if not (work / "out" / "micro.json").exists():
        raise SystemExit(f"bench_p9: micro failed (exit {rc}):\n{stderr[-3000:]}")
    got: dict[str, float] = json.loads((work / "out" / "micro.json").read_text())
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=15, help="steps left out of the steady state")
    ap.add_argument("--ckpt-every", type=int, default=20)
    ap.add_argument("--micro", type=int, default=500, help="steps of the run-API microbenchmark (0: skip)")
    ap.add_argument("--timeout", type=float, default=240, help="seconds per trial (a hang at exit is cut)")
    ap.add_argument("--with-all-threads", action="store_true", help=f"add the {ALL_THREADS} variant")
    ap.add_argument("--out", default="p9_threads.json", help="file name under benchmarks/results/")
    args = ap.parse_args()
    if args.repeats < 1 or args.steps < args.warmup + 10 or args.ckpt_every < 1 or args.micro < 0:
        print(
            "bench_p9: need --repeats >= 1, --steps >= --warmup + 10, --ckpt-every >= 1, --micro >= 0",
            file=sys.stderr,
        )
        return 2
    root = Path(tempfile.mkdtemp(prefix="gpufleet-p9-"))
    rows: list[dict[str, Any]] = []
    variants = VARIANTS + ((ALL_THREADS,) if args.with_all_threads else ())
    try:
        for i in range(args.repeats):
            order = variants[i % len(variants) :] + variants[: i % len(variants)]
            for v in order:
                row = one_trial(v, args, root, i)
                rows.append(row)
                print(
                    f"  repeat {i} {v:<14} mean {row['mean_s'] * 1e3:7.1f} ms/step  median "
                    f"{row['median_s'] * 1e3:7.1f}  threads {row['threads']}  load {row['load1']}",
                    flush=True,
                )
        micro_res = micro(args, root) if args.micro else None
    finally:
        shutil.rmtree(root, ignore_errors=True)

    summary: dict[str, dict[str, float]] = {}
    for v in variants:
        mine = [r for r in rows if r["variant"] == v]
        summary[v] = {
            "mean_s": statistics.median(r["mean_s"] for r in mine),
            "median_s": statistics.median(r["median_s"] for r in mine),
        }
        cpus = [r["cpu_mean_s"] for r in mine if "cpu_mean_s" in r]
        if cpus:
            summary[v]["cpu_s"] = statistics.median(cpus)
    ratios = {
        "none": summary["gpufleet"]["mean_s"] / summary["torchrun"]["mean_s"],
        "ckpt": summary["gpufleet+ckpt"]["mean_s"] / summary["torchrun+ckpt"]["mean_s"],
    }
    # Paired: each repeat's variants ran back to back, so their ratio shares that repeat's machine load.
    by = {(r["variant"], r["repeat"]): r["mean_s"] for r in rows}
    paired = {
        k: statistics.median(by[f"gpufleet{sfx}", i] / by[f"torchrun{sfx}", i] for i in range(args.repeats))
        for k, sfx in (("none", ""), ("ckpt", "+ckpt"))
    }
    loads = [r["load1"] for r in rows]
    print(
        f"\nP9: steady-state step time, {args.steps} steps (first {args.warmup} left out), "
        f"{args.repeats} repeat(s), medians; load average {min(loads)}-{max(loads)} on {os.cpu_count()} CPUs"
    )
    print(f"{'variant':<21}{'mean ms/step':>14}{'median ms/step':>16}{'rank-0 CPU ms/step':>20}")
    for v in variants:
        cpu_ms = f"{summary[v]['cpu_s'] * 1e3:.1f}" if "cpu_s" in summary[v] else "-"
        print(f"{v:<21}{summary[v]['mean_s'] * 1e3:>14.1f}{summary[v]['median_s'] * 1e3:>16.1f}{cpu_ms:>20}")
    for k, label in (("none", "no checkpoints"), ("ckpt", f"checkpoint every {args.ckpt_every}")):
        verdict = "met" if ratios[k] <= GOALS[k] else "MISSED"
        print(
            f"gpufleet / torchrun, {label}: {ratios[k]:.3f}x (goal <= {GOALS[k]}x: {verdict}); "
            f"median of per-repeat ratios {paired[k]:.3f}x"
        )
    if micro_res:
        print(
            f"run API per step ({micro_res['n']} steps, 2 ranks): all_reduce alone "
            f"{micro_res['allreduce_us']:.0f} us; empty run.steps() step {micro_res['step_empty_us']:.0f} us; "
            f"with run.log(loss=) {micro_res['step_log_us']:.0f} us"
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {
        "benchmark": "P9 worker defaults: gpufleet run vs torchrun, unpinned threads",
        "args": vars(args),
        "host": {
            "cpus": os.cpu_count(),
            "affinity": len(os.sched_getaffinity(0)),
            "python": platform.python_version(),
            "load_end": os.getloadavg(),
        },
        "summary": summary,
        "ratios": ratios,
        "paired_ratios": paired,
        "goals": GOALS,
        "micro": micro_res,
        "trials": rows,
    }
    (RESULTS / args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {RESULTS / args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

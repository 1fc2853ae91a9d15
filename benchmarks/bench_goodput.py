# ruff: noqa: E501
"""P4 goodput: measured goodput under failures at a set MTBF vs the Young–Daly analytic optimum.

One fixed job (``--steps`` steps of the benchcommon MLP, 2 ranks, gloo) runs under ``gpufleet run``
with failures drawn at MTBF ``--mtbf`` M, once per checkpoint policy:

* ``auto``  ``--checkpoint-every auto --mtbf M`` (Daly's interval, δ and persist time measured online)
* ``1``     every step (far too often: at most one save in flight, so most are skipped)
* ``200``   every 200 steps (far too rare: half the job)

**Failures.** A seeded list of exponential draws (mean M) is handed to the script; attempt ``a``
kills rank 1 (SIGKILL) ``schedule[a]`` seconds after its first completed step. All policies get the
same list. Why not ``--inject kill:rank=1,after=Ts`` specs: every not-yet-fired spec is armed in
every attempt and ``after`` counts from that attempt's start, so with several specs the smallest
remaining one always fires first: the draws would be consumed in ascending order, not as drawn.

**Compared.** Everything comes from the run's ledger (``gpufleet.reliability.metrics``):

* measured goodput = productive step time ÷ wall. ``steady`` leaves out the job's one-off start
  (supervisor start → first step) and end (last step → run end: final checkpoint, shutdown), which
  the analytic model does not have; ``full`` keeps them.
* analytic optimum = ``optimal_goodput(δ, M, R, persist_s=p, min_tau=step)`` with δ = blocking time
  per checkpoint, R = restart time per failure (MTTR minus one step's work), p = median persist time,
  all measured in the same run; M is the MTBF realised in the same steady window (up-time there ÷
  failures: with a handful of failures the count differs from the nominal M by chance, and this
  removes that noise); the optimum at the nominal M is listed too.
* per policy the first-order model at its own measured interval, ``expected_goodput(τ, ...)``.
* a throughput cross-check: productive steps × clean step time ÷ steady wall, where a clean step is
  one not overlapping a persist. The ledger's goodput counts a step slowed by a background persist
  as fully productive; this one does not. It is compared with the optimum at δ_eff = δ + the extra
  step time per checkpoint while persisting (the interference).

``python benchmarks/bench_goodput.py`` (~3–4 min); JSON to benchmarks/results/p4_goodput.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SCRIPTS = HERE / "scripts"
RESULTS = HERE / "results"
BIN = Path(sys.executable).parent


def kill_schedule(mtbf: float, seed: int, n: int = 200) -> list[float]:
    rng = random.Random(seed)
    return [round(rng.expovariate(1.0 / mtbf), 3) for _ in range(n)]


def run_policy(policy: str, sched: list[float], args: argparse.Namespace, root: Path) -> Path:
    work = root / f"policy-{policy}"
    work.mkdir(parents=True)
    cmd = [
        str(BIN / "gpufleet"), "run", "-n", "2",
        "--run-dir", str(work / "run"),
        "--checkpoint-every", policy,
        "--mtbf", str(args.mtbf),
        "--max-restarts", "1000",
        "--max-no-progress", "0",  # a rare-checkpoint baseline may fail twice before its first save
        "--no-progress",
        "--", sys.executable, str(SCRIPTS / "goodput_train.py"),
        "--steps", str(args.steps), "--width", str(args.width),
    ]  # fmt: skip
    env = {
        **os.environ,
        "BENCH_OUT": str(work / "out"),
        "BENCH_KILL_SCHEDULE": ",".join(str(x) for x in sched),
    }
    env.pop("OMP_NUM_THREADS", None)  # no thread pinning: gpufleet's own defaults decide
    with open(work / "log.txt", "wb") as log:
        try:
            subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            pass
    return work


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def analyse(work: Path, policy: str, args: argparse.Namespace) -> dict[str, Any]:
    from gpufleet.core.ledger import read_events
    from gpufleet.reliability.interval import expected_goodput, optimal_goodput, young
    from gpufleet.reliability.metrics import summarize

    events = read_events(work / "run")
    s = summarize(events)
    ev = lambda name: [e for e in events if e.get("ev") == name]  # noqa: E731
    steps = ev("step")
    start = ev("run_start")[0]["t"]
    end = ev("run_end")[-1]["t"] if ev("run_end") else max(e["t"] for e in events)
    status = ev("run_end")[-1].get("status") if ev("run_end") else "unknown"
    first_begin = min(e["t"] - e["dt"] for e in steps)
    last_end = max(e["t"] for e in steps)
    startup_s, shutdown_s = first_begin - start, end - last_end
    wall = s["wall_s"]
    steady_wall = wall - startup_s - shutdown_s
    productive = s["productive_s"]
    works = [max(e["dt"] - e.get("stall", 0.0), 0.0) for e in steps]
    step_s = _median(works) or 0.0

    # Blocking time per checkpoint: every stall the steps paid (save call + wait for staging) / saves.
    staged = ev("ckpt_staged")
    committed = ev("ckpt_committed")
    total_stall = sum(e.get("stall", 0.0) for e in steps)
    delta = total_stall / len(staged) if staged else 0.0
    persist = _median([e["persist_s"] for e in committed]) or 0.0
    # Restart time per failure: MTTR (happened -> first step done) minus that first step's work.
    inc = [i for i in s["incidents"] if i["recovered"]]
    mttrs = [i["mttr_s"] for i in inc]
    restart = max((sum(mttrs) / len(mttrs)) - step_s, 0.0) if mttrs else 0.0
    m_real = s["mtbf_s"]
    # The interval actually used: step work executed (kept or not) per checkpoint started.
    tau = sum(works) / len(staged) if staged else float("inf")

    # Clean step: not the first of an attempt, not overlapping a persist window.
    windows = [(e["t"] - e.get("persist_s", 0.0), e["t"]) for e in committed]
    first_of_attempt = {}
    for e in steps:
        first_of_attempt.setdefault((e.get("session"), e.get("attempt")), e["t"])
    clean = [
        max(e["dt"] - e.get("stall", 0.0), 0.0)
        for e in steps
        if e["t"] != first_of_attempt[(e.get("session"), e.get("attempt"))]
        and not any(a < e["t"] and e["t"] - e["dt"] < b for a, b in windows)
    ]
    clean_step = _median(clean) or step_s
    done = s["steps"]["productive"]
    # Interference: how much longer the steps overlapping a persist took than a clean step, per
    # checkpoint (background persist competes with training for CPU); δ_eff = δ + that.
    overlapping = [
        max(e["dt"] - e.get("stall", 0.0), 0.0) - clean_step
        for e in steps
        if any(a < e["t"] and e["t"] - e["dt"] < b for a, b in windows)
    ]
    interference = sum(overlapping) / len(staged) if staged else 0.0
    delta_eff = delta + max(interference, 0.0)
    # MTBF over the same steady window: up-time there (steady wall minus recoveries) / failures.
    downtime = sum(i["mttr_s"] for i in inc)
    m_steady = (steady_wall - downtime) / s["failures"]["count"] if s["failures"]["count"] else None

    def models(m: float | None, d: float = delta) -> dict[str, Any] | None:
        if not m:
            return None
        return {
            "mtbf_s": m,
            "delta_s": d,
            "young_tau_s": young(d, m),
            "optimal_goodput": optimal_goodput(d, m, restart, persist_s=persist, min_tau=step_s),
            "expected_goodput_at_measured_tau": expected_goodput(
                min(tau, 1e12), d, m, restart, persist_s=persist
            ),
        }

    decisions = s["interval"]
    return {
        "policy": policy,
        "status": status,
        "steps_done": done,
        "steps_executed": s["steps"]["executed"],
        "failures": s["failures"]["count"],
        "restarts": s["restarts"],
        "wall_s": wall,
        "steady_wall_s": steady_wall,
        "startup_s": startup_s,
        "shutdown_s": shutdown_s,
        "productive_s": productive,
        "goodput_full": productive / wall if wall else None,
        "goodput_steady": productive / steady_wall if steady_wall else None,
        "goodput_throughput": done * clean_step / steady_wall if steady_wall else None,
        "measured": {
            "delta_s": delta,
            "stall_median_s": s["checkpoints"]["stall_s"]["p50"],
            "persist_median_s": persist,
            "restart_s": restart,
            "mttr_mean_s": s["mttr"]["mean_s"],
            "mttr_phases_mean_s": s["mttr"]["phases_mean_s"],
            "step_s": step_s,
            "clean_step_s": clean_step,
            "tau_work_s": tau if tau != float("inf") else None,
            "checkpoints_started": len(staged),
            "checkpoints_committed": len(committed),
            "checkpoints_skipped": s["checkpoints"]["skipped"],
            "mtbf_realised_s": m_steady,
            "mtbf_ledger_s": m_real,
            "interference_per_ckpt_s": interference,
            "delta_effective_s": delta_eff,
            "badput_s": {k: v["s"] for k, v in s["badput"].items()},
        },
        "model_nominal_M": models(args.mtbf),
        "model_realised_M": models(m_steady),
        "model_realised_M_ledger_uptime": models(m_real),
        "model_realised_M_effective_delta": models(m_steady, delta_eff),
        "interval_decisions": [
            {
                k: d.get(k)
                for k in (
                    "step",
                    "model",
                    "every_steps",
                    "every_s",
                    "delta_s",
                    "mtbf_s",
                    "mtbf_source",
                    "persist_s",
                )
            }
            for d in decisions
        ],
    }


def render(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    c = Console(width=160)
    t = Table(
        title=f"P4 goodput: {res['config']['steps']} steps, 2 ranks, failures at MTBF {res['config']['mtbf_s']:.0f}s (seed {res['config']['seed']})"
    )
    for h in (
        "policy",
        "fail",
        "ckpts started/skipped",
        "τ s",
        "goodput full",
        "goodput steady",
        "model@τ",
        "optimum",
        "optimum (nominal M)",
        "steady ÷ optimum",
        "throughput",
        "optimum δ_eff",
        "thru ÷ opt δ_eff",
    ):
        t.add_column(h, justify="right")
    for r in res["policies"]:
        mr, mn = r["model_realised_M"] or {}, r["model_nominal_M"] or {}
        me = r["model_realised_M_effective_delta"] or {}
        opt = mr.get("optimal_goodput")
        ratio = r["goodput_steady"] / opt if opt else None
        opte = me.get("optimal_goodput")
        tau = r["measured"]["tau_work_s"]
        t.add_row(
            r["policy"],
            str(r["failures"]),
            f"{r['measured']['checkpoints_started']}/{r['measured']['checkpoints_skipped']}",
            f"{tau:.2f}" if tau else "-",
            f"{r['goodput_full']:.3f}",
            f"{r['goodput_steady']:.3f}",
            f"{mr.get('expected_goodput_at_measured_tau', 0):.3f}",
            f"{opt:.3f}" if opt else "-",
            f"{mn.get('optimal_goodput', 0):.3f}",
            f"{ratio:.3f}" if ratio else "-",
            f"{r['goodput_throughput']:.3f}",
            f"{opte:.3f}" if opte else "-",
            f"{r['goodput_throughput'] / opte:.3f}" if opte else "-",
        )
    c.print(t)
    m = res["policies"][0]["measured"]
    c.print(
        f"auto, measured in the run: δ={m['delta_s'] * 1e3:.1f} ms/ckpt, persist p={m['persist_median_s']:.2f}s, "
        f"restart R={m['restart_s']:.2f}s, step={m['step_s'] * 1e3:.0f} ms, realised MTBF={m['mtbf_realised_s'] or float('nan'):.1f}s; "
        f"persist interference {m['interference_per_ckpt_s'] * 1e3:.0f} ms/ckpt -> δ_eff={m['delta_effective_s'] * 1e3:.0f} ms"
    )
    c.print(
        "optimum / model@τ: first-order model at the measured δ, R, p and the MTBF realised in the steady window"
    )
    g = res["auto_vs_optimum"]
    verdict = "[green]met[/]" if g is not None and g >= 0.95 else "[red]not met[/]"
    c.print(
        f"auto steady goodput / analytic optimum (realised M) = {g:.3f} (goal >= 0.95): {verdict}"
        if g
        else "no ratio"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mtbf", type=float, default=15.0, help="mean seconds of up-time between failures")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--width", type=int, default=1024, help="MLP width (1024: ~38 MB model+AdamW)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--policies", default="auto,1,200", help="--checkpoint-every values; the first is compared"
    )
    ap.add_argument("--timeout", type=float, default=240.0, help="per policy run, seconds")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--out", default=str(RESULTS / "p4_goodput.json"))
    args = ap.parse_args()
    sched = kill_schedule(args.mtbf, args.seed)
    root = Path(tempfile.mkdtemp(prefix="p4_goodput_"))
    rows = []
    try:
        for policy in [p for p in args.policies.split(",") if p]:
            t0 = time.time()
            work = run_policy(policy, sched, args, root)
            r = analyse(work, policy, args)
            rows.append(r)
            print(
                f"  policy {policy:5s} {r['status']}: {r['failures']} failures, goodput steady "
                f"{r['goodput_steady']:.3f} ({time.time() - t0:.0f}s)",
                file=sys.stderr,
            )
    finally:
        if args.keep:
            print(f"run directories kept under {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)
    first = rows[0]
    opt = (first["model_realised_M"] or {}).get("optimal_goodput")
    res = {
        "benchmark": "p4_goodput",
        "goal": "goodput with --checkpoint-every auto >= 95% of the Young-Daly analytic optimum",
        "config": {
            "mtbf_s": args.mtbf,
            "seed": args.seed,
            "steps": args.steps,
            "width": args.width,
            "world_size": 2,
            "failure_model": "per attempt, rank 1 SIGKILL after Exp(mean M) s of up-time (from the attempt's "
            "first completed step); the same seeded draws for every policy",
            "kill_schedule_head": sched[:12],
        },
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_avg_end": os.getloadavg(),
        },
        "policies": rows,
        "auto_vs_optimum": first["goodput_steady"] / opt if opt else None,
        "auto_vs_optimum_nominal_M": first["goodput_steady"] / first["model_nominal_M"]["optimal_goodput"],
        "auto_full_vs_optimum": first["goodput_full"] / opt if opt else None,
    }
    res["goal_met"] = bool(res["auto_vs_optimum"] and res["auto_vs_optimum"] >= 0.95)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    render(res)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0 if all(r["status"] == "completed" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

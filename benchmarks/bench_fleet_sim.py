"""Fleet simulator speed (goal: 100K GPUs x 90 days x 1,000 replicates in < 30 s on 2 cores), a SimPy
baseline of the same model, and the validation table (``--validate``).

    flock /tmp/gpufleet_heavy.lock nice -n 5 .venv/bin/python benchmarks/bench_fleet_sim.py --validate

* engine: each of the eight strategies of the llama3-h100 profile at the goal size, ``--repeats``
  times, median wall time per strategy (and of the whole table);
* SimPy: the same job (one Poisson failure process at the profile's total rate, sync checkpoints at
  the engine's interval, a recovery of detect + restart + load that a failure restarts) written the
  way SimPy is meant to be used: a job process and a failure process that interrupts it. It runs
  ``--simpy-replicates`` replicates; its time is scaled to 1,000, and its ETTR is compared with the
  engine's on the same scenario (two independent implementations of one model);
* ``--validate``: every validation row of :mod:`gpufleet.fleet.validate` (as the tests run them, at
  full replicate counts).

Writes benchmarks/results/fleet_sim.json. The load average is recorded before and after.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from gpufleet.fleet.engine import Scenario, simulate  # noqa: E402
from gpufleet.fleet.profiles import load_profile  # noqa: E402
from gpufleet.fleet.strategies import strategies  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def bench_engine(gpus: int, days: float, reps: int, repeats: int) -> dict:
    prof = load_profile("llama3-h100")
    sts = strategies(prof, gpus)
    per: dict[str, list[float]] = {s.name: [] for s in sts}
    totals = []
    events = None
    for r in range(repeats):
        t_all = 0.0
        for st in sts:
            t0 = time.perf_counter()
            res = simulate(Scenario.build(prof, gpus, days, st), reps, seed=r)
            dt = time.perf_counter() - t0
            per[st.name].append(dt)
            t_all += dt
            events = float(res.failures.mean() + res.planned.mean())
        totals.append(t_all)
    return {
        "gpus": gpus,
        "days": days,
        "replicates": reps,
        "repeats": repeats,
        "interruptions_per_replicate": events,
        "median_s": {k: statistics.median(v) for k, v in per.items()},
        "runs_s": per,
        "table_median_s": statistics.median(totals),
    }


def simpy_job(env, rate: float, tau: float, delta: float, recover: float, rng, acc: dict) -> None:
    """SimPy: a job that works tau, stalls delta (commit), and a failure process that interrupts it."""
    import simpy

    def job():
        while True:
            try:
                start = env.now
                yield env.timeout(tau)
                yield env.timeout(delta)
                acc["work"] += tau
                acc["stall"] += delta
            except simpy.Interrupt:
                done = env.now - start
                acc["lost"] += min(done, tau)
                acc["stall"] += max(done - tau, 0.0)
                while True:  # recovery; a failure during it restarts it
                    try:
                        yield env.timeout(recover)
                        break
                    except simpy.Interrupt:
                        pass

    proc = env.process(job())

    def failures():
        while True:
            yield env.timeout(rng.exponential(1.0 / rate))
            acc["failures"] += 1
            proc.interrupt()

    env.process(failures())


def bench_simpy(gpus: int, days: float, reps: int) -> dict | None:
    try:
        import simpy
    except ImportError:
        return None
    import numpy as np

    prof = load_profile("llama3-h100")
    base = next(s for s in strategies(prof, gpus) if s.name == "sync")
    rec = prof.recovery
    recover = rec.detect_s + rec.restart_s + base.load_s
    sc = Scenario.build(prof, gpus, days, base)
    rate = sum(sc.cause_rates)
    tau, _ = sc.intervals()
    # The engine on the identical model: one cause, no node replacement, no planned interruptions.
    st = replace(base, interval_s=tau)
    one = Scenario(
        gpus=gpus,
        horizon_s=days * 86400.0,
        cause_names=("all",),
        cause_rates=(rate,),
        cause_replace=(False,),
        cause_peer=(True,),
        detect_s=rec.detect_s,
        restart_s=rec.restart_s,
        strategy=st,
    )
    t0 = time.perf_counter()
    eng = simulate(one, 1000, seed=0)
    t_eng = time.perf_counter() - t0
    ettrs, events = [], 0
    t0 = time.perf_counter()
    for r in range(reps):
        env = simpy.Environment()
        acc = {"work": 0.0, "lost": 0.0, "stall": 0.0, "failures": 0}
        simpy_job(env, rate, tau, st.stall_s, recover, np.random.default_rng(r), acc)
        env.run(until=days * 86400.0)
        ettrs.append(acc["work"] / (days * 86400.0))
        events += acc["failures"] + int(days * 86400.0 / (tau + st.stall_s))
    t_simpy = time.perf_counter() - t0
    return {
        "model": "one Poisson cause at the profile's total rate, sync checkpoints, detect+restart+load",
        "interval_s": tau,
        "simpy_replicates": reps,
        "simpy_s": t_simpy,
        "simpy_s_per_1000": t_simpy / reps * 1000,
        "simpy_events_per_s": events / t_simpy,
        "engine_s_1000": t_eng,
        "speedup": (t_simpy / reps * 1000) / t_eng,
        "simpy_ettr_mean": statistics.fmean(ettrs),
        "simpy_ettr_sd": statistics.stdev(ettrs) if len(ettrs) > 1 else 0.0,
        "engine_ettr_mean": float(eng.ettr.mean()),
        "engine_ettr_sd": float(eng.ettr.std(ddof=1)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=100000)
    ap.add_argument("--days", type=float, default=90.0)
    ap.add_argument("--replicates", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--simpy-replicates", type=int, default=3)
    ap.add_argument("--validate", action="store_true", help="Also run every validation row.")
    ap.add_argument("--out", type=Path, default=RESULTS / "fleet_sim.json")
    a = ap.parse_args()

    out: dict = {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()}
    import numpy as np

    out["numpy"] = np.__version__
    out["loadavg_before"] = loadavg()
    eng = bench_engine(a.gpus, a.days, a.replicates, a.repeats)
    out["engine"] = eng
    print(
        f"engine: {a.gpus:,} GPUs x {a.days:g} d x {a.replicates} replicates "
        f"(~{eng['interruptions_per_replicate']:.0f} interruptions each), median of {a.repeats}:"
    )
    for k, v in eng["median_s"].items():
        print(f"  {k:24s} {v:6.2f} s   (goal < 30 s: {'met' if v < 30 else 'NOT met'})")
    print(f"  all eight strategies     {eng['table_median_s']:6.2f} s")
    sp = bench_simpy(a.gpus, a.days, a.simpy_replicates)
    out["simpy"] = sp
    if sp:
        print(
            f"SimPy baseline ({sp['simpy_replicates']} replicates): {sp['simpy_s']:.1f} s "
            f"-> {sp['simpy_s_per_1000']:.0f} s per 1,000 ({sp['simpy_events_per_s']:,.0f} events/s); "
            f"engine {sp['engine_s_1000']:.2f} s -> {sp['speedup']:.0f}x faster"
        )
        print(
            f"  same model, ETTR: SimPy {sp['simpy_ettr_mean']:.4f} (sd {sp['simpy_ettr_sd']:.4f}), "
            f"engine {sp['engine_ettr_mean']:.4f} (sd {sp['engine_ettr_sd']:.4f})"
        )
    else:
        print("SimPy not installed: baseline skipped (pip install simpy)")
    if a.validate:
        from gpufleet.fleet.validate import run_all

        t0 = time.perf_counter()
        rows = run_all()
        out["validation_s"] = time.perf_counter() - t0
        out["validation"] = [
            {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in r.items()} for r in rows
        ]
        bad = [r for r in rows if not r["ok"]]
        print(f"validation: {len(rows)} rows, {len(bad)} outside tolerance, {out['validation_s']:.1f} s")
        for r in rows:
            tol = "-" if math.isinf(r["tolerance"]) else f"{r['tolerance']:.0%}"
            verdict = ("ok" if tol != "-" else "sim>est") if r["ok"] else "FAIL"
            print(
                f"  {r['check']:78s} {r['reference']:10.4g} {r['simulated']:10.4g} "
                f"{r['deviation']:+8.2%} {tol:>4s} {verdict}"
            )
    out["loadavg_after"] = loadavg()
    print(f"load average before {out['loadavg_before']}, after {out['loadavg_after']}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1, default=float))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()

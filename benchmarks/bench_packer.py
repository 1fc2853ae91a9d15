"""P7 (packer): CP-SAT vs first-fit decreasing on synthetic fleets of 5, 20 and 50 workloads.

Workloads are seeded: a mix of aggregated replicas (TP 1/2/4/8) and disaggregated P/D groups
(prefill and decode instances of TP 1/2/4 sharing a pd_group). Fleets, each with ~25% headroom:
NVL72 racks; NVL72 + NVL36 racks at different costs (mixed); 8-GPU nodes; NVL72 with
anti-affinity. For each size: CP-SAT solve time, status, cost, best bound; FFD time and cost;
the gap of each to the bound; median of --repeats. Writes
benchmarks/results/p7_packer.json.

    .venv/bin/python benchmarks/bench_packer.py [--repeats 3] [--time-limit 10] [--workers 8]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from gpufleet.serve.common.racks import Domain, parse_nodes, parse_racks  # noqa: E402
from gpufleet.serve.pack.plans import Workload, parse_plan  # noqa: E402
from gpufleet.serve.pack.solver import PackInfeasible, PackResult, pack  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def synthetic(n: int, seed: int, max_pd: int = 72) -> list[Workload]:
    """``n`` seeded workloads: ~60% aggregated (1-6 replicas of TP 1/2/4/8), ~40% P/D (1-3 groups)."""
    rng = random.Random(seed)
    out = []
    for w in range(n):
        groups: list[dict[str, Any]] = []
        if rng.random() < 0.6:
            tp = rng.choice([1, 2, 4, 8])
            groups = [{"id": f"r{i}", "role": "replica", "gpus": tp} for i in range(rng.randint(1, 6))]
        else:
            ptp, dtp = rng.choice([1, 2, 4]), rng.choice([1, 2, 4])
            np_, nd = rng.randint(1, 3), rng.randint(1, 4)
            while np_ * ptp + nd * dtp > max_pd:
                nd = max(1, nd - 1)
                np_ = max(1, np_ - 1) if np_ * ptp + nd * dtp > max_pd else np_
            for k in range(rng.randint(1, 3)):
                groups += [
                    {"id": f"p{k}.{i}", "role": "prefill", "gpus": ptp, "pd_group": f"pd{k}"}
                    for i in range(np_)
                ]
                groups += [
                    {"id": f"d{k}.{i}", "role": "decode", "gpus": dtp, "pd_group": f"pd{k}"}
                    for i in range(nd)
                ]
        out.append(parse_plan({"workload": f"w{w:02d}", "groups": groups}, f"synthetic:{w}"))
    return out


def fleet_for(wls: list[Workload], kind: str, anti: bool) -> list[Domain]:
    demand = sum(w.gpus for w in wls)
    if kind == "nvl72":  # anti-affinity: at least as many racks as a workload's replicas (<= 6)
        return parse_racks(f"nvl72:{max(math.ceil(demand * 1.25 / 72) + 1, 6 if anti else 0)}")
    if kind == "mixed":  # NVL72 at 1.0 and NVL36 at 0.55 per rack (cost per GPU: 0.0139 vs 0.0153)
        k = math.ceil(demand * 1.25 / 108) + 1
        return parse_racks(f"nvl72:{k},nvl36:{k}@0.55")
    return parse_nodes(f"8x{math.ceil(demand * 1.25 / 8) + 1}")


def one(n: int, kind: str, a: argparse.Namespace) -> dict[str, Any]:
    anti = kind.endswith("-anti")
    kind = kind.removesuffix("-anti")
    wls = synthetic(n, a.seed + n, max_pd=8 if kind == "hgx8" else 36)
    fleet = fleet_for(wls, kind, anti)
    cp_runs, ffd_runs = [], []
    for _ in range(a.repeats):
        cp_runs.append(
            pack(wls, fleet, anti_affinity=anti, time_limit=a.time_limit, workers=a.workers, seed=0)
        )
        t0 = time.perf_counter()
        try:
            f: PackResult | None = pack(wls, fleet, anti_affinity=anti, solver="ffd")
        except PackInfeasible:  # FFD can fail where a placement exists (anti-affinity)
            f = None
        ffd_runs.append((time.perf_counter() - t0, f))
    cp = cp_runs[0]
    bound = max(r.bound for r in cp_runs)
    f0 = ffd_runs[0][1]
    ffd_cost = f0.cost if f0 is not None else None
    return {
        "workloads": n,
        "fleet": kind + ("-anti" if anti else ""),
        "anti_affinity": anti,
        "domains": len(fleet),
        "items": len(cp.items),
        "gpus_demanded": sum(w.gpus for w in wls),
        "gpus_in_fleet": sum(d.gpus for d in fleet),
        "cpsat": {
            "median_s": statistics.median(r.solve_s for r in cp_runs),
            "times_s": [r.solve_s for r in cp_runs],
            "status": [r.status for r in cp_runs],
            "method": [r.method for r in cp_runs],
            "cost": statistics.median(r.cost for r in cp_runs),
            "bound": bound,
            "gap": statistics.median(r.gap for r in cp_runs),
            "fragmentation": cp.fragmentation,
        },
        "ffd": {
            "median_s": statistics.median(t for t, _ in ffd_runs),
            "cost": ffd_cost,
            "gap": (ffd_cost - bound) / bound if bound > 0 and ffd_cost is not None else None,
            "fragmentation": f0.fragmentation if f0 is not None else None,
            "found": f0 is not None,
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--time-limit", type=float, default=10.0)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--sizes", default="5,20,50")
    ap.add_argument("--fleets", default="nvl72,mixed,hgx8,nvl72-anti")
    ap.add_argument("--out", type=Path, default=RESULTS / "p7_packer.json")
    a = ap.parse_args()
    rows = []
    hdr = (
        f"{'fleet':10} {'wl':>3} {'items':>5} {'GPUs':>5} {'dom':>4} | {'CP-SAT s':>8} {'status':>8} "
        f"{'cost':>5} {'bound':>5} {'gap':>6} | {'FFD s':>7} {'cost':>5} {'gap':>6} | "
        f"{'FFD/CP cost':>11} {'CP/FFD time':>11}"
    )
    print(hdr)
    print("-" * len(hdr))
    for kind in a.fleets.split(","):
        for n in (int(x) for x in a.sizes.split(",")):
            r = one(n, kind, a)
            rows.append(r)
            c, f = r["cpsat"], r["ffd"]
            r["ratio_cost_ffd_over_cpsat"] = f["cost"] / c["cost"] if f["found"] else None
            r["ratio_time_cpsat_over_ffd"] = c["median_s"] / max(f["median_s"], 1e-9)
            st = "/".join(sorted(set(c["status"])))
            print(
                f"{r['fleet']:10} {n:>3} {r['items']:>5} {r['gpus_demanded']:>5} {r['domains']:>4} | "
                f"{c['median_s']:>8.3f} {st:>8} {c['cost']:>5g} {c['bound']:>5g} {c['gap']:>6.1%} | "
                f"{f['median_s']:>7.4f} "
                + (
                    f"{f['cost']:>5g} {f['gap']:>6.1%} | {r['ratio_cost_ffd_over_cpsat']:>11.3f} "
                    if f["found"]
                    else f"{'none':>5} {'-':>6} | {'-':>11} "
                )
                + f"{r['ratio_time_cpsat_over_ffd']:>11.0f}",
                flush=True,
            )
    result = {
        "benchmark": "p7_packer",
        "tool": "gpufleet serve pack",
        "params": {
            "repeats": a.repeats,
            "time_limit_s": a.time_limit,
            "num_workers": a.workers,
            "seed": a.seed,
        },
        "host": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "measured_unix": time.time(),
        "rows": rows,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2))
    print(f"-> {a.out}")


if __name__ == "__main__":
    main()

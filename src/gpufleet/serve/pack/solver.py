"""The packer behind ``gpufleet serve pack``: place plans' engine instances into NVLink domains.

Model (docs/serve-pack.md). An *item* is what must sit in one domain as a whole: a P/D group (all
instances sharing a ``pd_group``) or a lone instance. Identical items of one workload are counted,
not enumerated: ``n[t, d]`` = items of type ``t`` in domain ``d``. Constraints: capacity; optional
anti-affinity (at most one item of a (workload, role) per domain); loads of identical domains are
ordered (symmetry breaking). Objective, lexicographic: Σ cost of used domains, then fragmentation
(used domains left partly free). CP-SAT runs with a fixed seed and ``num_workers``, hinted with
first-fit-decreasing (FFD); when the time limit stops it before a proof, the cheaper of its best
solution and FFD is returned with the gap to CP-SAT's best bound. OR-Tools is imported lazily.
"""

from __future__ import annotations

import enum
import math
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gpufleet.core.errors import GpufleetError, UsageError
from gpufleet.serve.common.racks import Domain
from gpufleet.serve.pack.plans import Item, Workload, items_of

__all__ = [
    "PackError",
    "PackInfeasible",
    "PackResult",
    "PackStatus",
    "Solver",
    "pack",
    "ffd",
    "capacity_bound",
    "SCHEMA",
]

SCHEMA = "gpufleet.serve.placement"
VERSION = 1


class Solver(enum.StrEnum):
    """``--solver``: CP-SAT (with first-fit decreasing as its hint and fallback), or FFD alone."""

    CP_SAT = "cp-sat"
    FFD = "ffd"


class PackStatus(enum.StrEnum):
    """How good the placement is known to be."""

    OPTIMAL = "OPTIMAL"  # CP-SAT proved it optimal
    FEASIBLE = "FEASIBLE"  # the time limit hit first: the best placement found, the gap stated
    FFD = "FFD"  # first-fit decreasing alone, bound = the capacity bound (no CP-SAT run)


class PackError(GpufleetError):
    """The packer could not produce a placement (exit code 1)."""


class PackInfeasible(PackError):
    """The fleet cannot hold the plans; the message says what is short."""


@dataclass
class PackResult:
    fleet: list[Domain]
    workloads: list[Workload]
    items: list[Item]
    assign: list[int]  # item index → domain index
    method: Solver  # what found this placement
    status: PackStatus
    cost: float
    bound: float
    solve_s: float
    ffd_cost: float | None
    cpsat: dict[str, Any] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def gap(self) -> float:
        """(cost − bound) / bound: how far above the optimum this placement can at most be."""
        if self.status == PackStatus.OPTIMAL or self.bound <= 0:
            return 0.0
        return (self.cost - self.bound) / self.bound

    @property
    def ffd_gap(self) -> float | None:
        if self.ffd_cost is None or self.bound <= 0:
            return None
        return (self.ffd_cost - self.bound) / self.bound

    def loads(self) -> list[int]:
        out = [0] * len(self.fleet)
        for i, d in enumerate(self.assign):
            out[d] += self.items[i].gpus
        return out

    @property
    def fragmentation(self) -> int:
        return sum(1 for d, ld in enumerate(self.loads()) if 0 < ld < self.fleet[d].gpus)

    def slots(self) -> dict[int, tuple[int, int]]:
        """Item → [first, last+1) GPU slots in its domain; items of a workload are contiguous."""
        out: dict[int, tuple[int, int]] = {}
        nxt = [0] * len(self.fleet)
        for i in sorted(range(len(self.items)), key=lambda i: (self.assign[i], self.items[i].order)):
            d = self.assign[i]
            out[i] = (nxt[d], nxt[d] + self.items[i].gpus)
            nxt[d] += self.items[i].gpus
        return out

    def to_json(self) -> dict[str, Any]:
        loads, slots = self.loads(), self.slots()
        placements = []
        for i, it in enumerate(self.items):
            s = slots[i][0]
            for g in it.groups:
                placements.append(
                    {
                        "workload": it.workload,
                        "id": g.id,
                        "role": g.role,
                        "gpus": g.gpus,
                        "pd_group": g.pd_group,
                        "domain": self.fleet[self.assign[i]].name,
                        "slots": [s, s + g.gpus],
                    }
                )
                s += g.gpus
        domains = []
        for d, dom in enumerate(self.fleet):
            per: dict[str, int] = defaultdict(int)
            for i, a in enumerate(self.assign):
                if a == d:
                    per[self.items[i].workload] += self.items[i].gpus
            domains.append(
                {
                    "name": dom.name,
                    "type": dom.type,
                    "gpus": dom.gpus,
                    "cost": dom.cost,
                    "used": loads[d],
                    "free": dom.gpus - loads[d],
                    "workloads": dict(per),
                }
            )
        return {
            "schema": SCHEMA,
            "version": VERSION,
            "status": self.status,
            "method": self.method,
            "objective": {
                "cost": self.cost,
                "domains_used": sum(1 for x in loads if x),
                "fragmentation": self.fragmentation,
            },
            "bound": self.bound,
            "gap": self.gap,
            "solve_s": self.solve_s,
            "ffd": {"cost": self.ffd_cost, "gap": self.ffd_gap},
            "cpsat": self.cpsat,
            "params": self.params,
            "notes": self.notes,
            "workloads": [
                {
                    "name": w.name,
                    "mode": w.mode,
                    "gpus": w.gpus,
                    "source": w.source,
                    "anti_affinity": w.anti_affinity,
                }
                for w in self.workloads
            ],
            "domains": domains,
            "placements": placements,
        }


# ---------------------------------------------------------------- checks, bounds, FFD


def _fleet_text(fleet: Sequence[Domain]) -> str:
    kinds: dict[str, int] = defaultdict(int)
    for d in fleet:
        kinds[f"{d.type} ({d.gpus} GPUs)"] += 1
    return ", ".join(f"{n}× {k}" for k, n in kinds.items())


def _precheck(items: Sequence[Item], fleet: Sequence[Domain], anti: Sequence[bool]) -> None:
    demand, cap = sum(i.gpus for i in items), sum(d.gpus for d in fleet)
    if demand > cap:
        raise PackInfeasible(
            f"not enough capacity: the plans need {demand} GPUs, the fleet has {cap} "
            f"({_fleet_text(fleet)}); short by {demand - cap} GPUs"
        )
    big = max(d.gpus for d in fleet)
    for it in items:
        if it.gpus > big:
            raise PackInfeasible(
                f"{it.label()} of workload {it.workload!r} needs {it.gpus} GPUs in one "
                f"NVLink domain; the largest domain has {big}"
            )
    classes: dict[tuple[str, str], list[Item]] = defaultdict(list)
    for i, it in enumerate(items):
        if anti[i]:
            classes[(it.workload, it.role)].append(it)
    for (w, role), its in classes.items():
        room = sum(1 for d in fleet if d.gpus >= min(x.gpus for x in its))
        if len(its) > room:
            what = "P/D groups" if role == "pd" else f"{role} instances"
            raise PackInfeasible(
                f"anti-affinity: workload {w!r} has {len(its)} {what} but only {room} "
                f"domains can hold one; short by {len(its) - room} domain(s)"
            )


def capacity_bound(items: Sequence[Item], fleet: Sequence[Domain]) -> float:
    """A lower bound on cost: the cheapest GPUs per cost cover the demand (whole domains if uniform)."""
    demand = sum(i.gpus for i in items)
    if len({(d.gpus, d.cost) for d in fleet}) == 1:
        return math.ceil(demand / fleet[0].gpus) * fleet[0].cost
    bound, left = 0.0, demand
    for d in sorted(fleet, key=lambda d: d.cost / d.gpus):
        take = min(left, d.gpus)
        bound, left = bound + d.cost * take / d.gpus, left - take
        if left <= 0:
            break
    return bound


def ffd(items: Sequence[Item], fleet: Sequence[Domain], anti: Sequence[bool]) -> list[int] | None:
    """First-fit decreasing: items by size (largest first) into domains ordered by cost per GPU."""
    order = sorted(range(len(fleet)), key=lambda d: (fleet[d].cost / fleet[d].gpus, -fleet[d].gpus, d))
    free = [d.gpus for d in fleet]
    held: list[set[tuple[str, str]]] = [set() for _ in fleet]
    out = [-1] * len(items)
    for i in sorted(range(len(items)), key=lambda i: (-items[i].gpus, i)):
        it, cls = items[i], (items[i].workload, items[i].role)
        for d in order:
            if free[d] >= it.gpus and not (anti[i] and cls in held[d]):
                out[i], free[d] = d, free[d] - it.gpus
                if anti[i]:
                    held[d].add(cls)
                break
        else:
            return None
    return out


def _cost(fleet: Sequence[Domain], assign: Sequence[int]) -> float:
    return sum(fleet[d].cost for d in set(assign))


def _shortfall(items: Sequence[Item], fleet: Sequence[Domain], anti: Sequence[bool]) -> str:
    tpl = max(fleet, key=lambda d: (d.gpus, -d.cost))
    for extra in range(1, len(items) + 1):
        more = [Domain(f"extra-{k}", tpl.type, tpl.gpus, tpl.cost) for k in range(extra)]
        if ffd(items, [*fleet, *more], anti) is not None:
            return f"short: first-fit places everything with {extra} more {tpl.type} domain(s)"
    return "short: more domains than there are items"


# ---------------------------------------------------------------- CP-SAT


def _ortools() -> None:
    try:
        import ortools.sat.python.cp_model  # noqa: F401
    except ImportError:
        raise UsageError(
            "the packer needs OR-Tools: pip install 'gpufleet[pack]' (or use --solver ffd)"
        ) from None


def _scale(costs: Sequence[float]) -> int:
    for s in (1, 10, 100, 1000, 10000):
        if all(abs(c * s - round(c * s)) < 1e-9 for c in costs):
            return s
    return 10000


def _solve(
    items: Sequence[Item],
    fleet: Sequence[Domain],
    anti: Sequence[bool],
    hint: list[int] | None,
    time_limit: float,
    workers: int,
    seed: int,
) -> tuple[str, list[int] | None, float, dict[str, Any]]:
    from ortools.sat.python import cp_model

    types: dict[tuple[str, str, tuple[int, ...], bool], list[int]] = defaultdict(list)
    for i, it in enumerate(items):
        types[(it.workload, it.role, tuple(g.gpus for g in it.groups), anti[i])].append(i)
    tkeys = list(types)
    size = [items[types[k][0]].gpus for k in tkeys]
    scale = _scale([d.cost for d in fleet])
    big_k = len(fleet) + 1
    m = cp_model.CpModel()
    n: dict[tuple[int, int], Any] = {}
    for t, k in enumerate(tkeys):
        for d, dom in enumerate(fleet):
            ub = min(len(types[k]), dom.gpus // size[t], 1 if k[3] else len(types[k]))
            if ub > 0:
                n[t, d] = m.new_int_var(0, ub, f"n{t}_{d}")
        m.add(sum(n[t, d] for d in range(len(fleet)) if (t, d) in n) == len(types[k]))
    used = [m.new_bool_var(f"used{d}") for d in range(len(fleet))]
    full = [m.new_bool_var(f"full{d}") for d in range(len(fleet))]
    load = []
    for d, dom in enumerate(fleet):
        ld = m.new_int_var(0, dom.gpus, f"load{d}")
        m.add(ld == sum(size[t] * n[t, d] for t in range(len(tkeys)) if (t, d) in n))
        m.add(ld <= dom.gpus * used[d])
        m.add(ld >= 1).only_enforce_if(used[d])
        m.add(ld == dom.gpus).only_enforce_if(full[d])
        load.append(ld)
    classes: dict[tuple[str, str], list[int]] = defaultdict(list)
    for t, k in enumerate(tkeys):
        if k[3]:
            classes[(k[0], k[1])].append(t)
    for ts in classes.values():
        for d in range(len(fleet)):
            vs = [n[t, d] for t in ts if (t, d) in n]
            if len(vs) > 1:
                m.add(sum(vs) <= 1)
    for d in range(len(fleet) - 1):  # identical neighbours: order by load (symmetry breaking)
        a, b = fleet[d], fleet[d + 1]
        if (a.type, a.gpus, a.cost) == (b.type, b.gpus, b.cost):
            m.add(load[d] >= load[d + 1])
    m.add(sum(dom.gpus * used[d] for d, dom in enumerate(fleet)) >= sum(i.gpus for i in items))
    cost_i = [round(d.cost * scale) for d in fleet]
    m.minimize(big_k * sum(c * u for c, u in zip(cost_i, used, strict=True)) + sum(used) - sum(full))
    if hint is not None:
        for (t, d), v in n.items():
            m.add_hint(v, sum(1 for i in types[tkeys[t]] if hint[i] == d))
    s = cp_model.CpSolver()
    s.parameters.max_time_in_seconds = time_limit
    s.parameters.num_workers = workers
    s.parameters.random_seed = seed
    s.parameters.interleave_search = True  # deterministic for a fixed num_workers and seed
    t0 = time.perf_counter()
    st = s.solve(m)
    wall = time.perf_counter() - t0
    status = s.status_name(st)
    info: dict[str, Any] = {"status": status, "wall_s": wall, "types": len(tkeys), "vars": len(n)}
    bound = math.floor((s.best_objective_bound + 1e-6) / big_k) / scale if status != "INFEASIBLE" else 0.0
    if st not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return status, None, bound, info
    assign = [-1] * len(items)
    for t, k in enumerate(tkeys):
        pending = list(types[k])
        for d in range(len(fleet)):
            for _ in range(s.value(n[t, d]) if (t, d) in n else 0):
                assign[pending.pop(0)] = d
    info["objective"] = _cost(fleet, assign)
    info["bound"] = bound
    return status, assign, bound, info


def pack(
    workloads: Sequence[Workload],
    fleet: Sequence[Domain],
    *,
    anti_affinity: bool = False,
    time_limit: float = 10.0,
    workers: int = 8,
    seed: int = 0,
    solver: Solver | str = Solver.CP_SAT,
) -> PackResult:
    """Place every workload's items into ``fleet`` at the lowest cost (see the module doc)."""
    if solver not in tuple(Solver):
        raise ValueError(f"solver must be one of {', '.join(Solver)} (got {solver!r})")
    solver = Solver(solver)
    if not fleet:
        raise PackInfeasible("the fleet is empty")
    fleet, wls = list(fleet), list(workloads)
    items = items_of(wls)
    if not items:
        raise PackInfeasible("the plans hold no instances to place")
    by_name = {w.name: w for w in wls}
    anti = [anti_affinity or by_name[it.workload].anti_affinity for it in items]
    params = {
        "solver": solver,
        "time_limit_s": time_limit,
        "num_workers": workers,
        "seed": seed,
        "anti_affinity": anti_affinity,
    }
    _precheck(items, fleet, anti)
    if solver == Solver.CP_SAT:
        _ortools()
    t0 = time.perf_counter()
    f_assign = ffd(items, fleet, anti)
    f_cost = _cost(fleet, f_assign) if f_assign is not None else None
    cap_lb = capacity_bound(items, fleet)
    if solver == Solver.FFD:
        if f_assign is None or f_cost is None:
            raise PackInfeasible(f"first-fit decreasing found no placement; {_shortfall(items, fleet, anti)}")
        return PackResult(
            fleet,
            wls,
            items,
            f_assign,
            Solver.FFD,
            PackStatus.FFD,
            f_cost,
            cap_lb,
            time.perf_counter() - t0,
            f_cost,
            params=params,
            notes=["bound: capacity bound (no CP-SAT run)"],
        )
    status, c_assign, bound, info = _solve(items, fleet, anti, f_assign, time_limit, workers, seed)
    elapsed = time.perf_counter() - t0
    if status == "INFEASIBLE":
        raise PackInfeasible(
            f"no placement fits this fleet ({_fleet_text(fleet)}): capacity, NVLink-domain "
            f"or anti-affinity constraints conflict; {_shortfall(items, fleet, anti)}"
        )
    bound = max(bound, cap_lb)
    if status == "OPTIMAL" and c_assign is not None:
        return PackResult(
            fleet,
            wls,
            items,
            c_assign,
            Solver.CP_SAT,
            PackStatus.OPTIMAL,
            _cost(fleet, c_assign),
            bound,
            elapsed,
            f_cost,
            info,
            params,
        )
    notes = [f"CP-SAT stopped at the {time_limit:g}s time limit ({status}) before proving optimality"]
    tried = ((info.get("objective"), c_assign, Solver.CP_SAT), (f_cost, f_assign, Solver.FFD))
    cands = [(c, a, meth) for c, a, meth in tried if a is not None and c is not None]
    if not cands:
        raise PackError(
            f"no placement found within the {time_limit:g}s time limit and first-fit found "
            "none either; raise --time-limit"
        )
    cost, assign, method = min(cands, key=lambda x: (x[0], x[2] == Solver.CP_SAT))  # CP-SAT only if cheaper
    if method == Solver.FFD:
        notes.append("using the first-fit-decreasing placement (fallback)")
    if cost <= bound + 1e-9:
        notes.append("its cost equals the lower bound: optimal in cost (fragmentation tie-break unproven)")
    return PackResult(
        fleet,
        wls,
        items,
        assign,
        method,
        PackStatus.FEASIBLE,
        cost,
        bound,
        elapsed,
        f_cost,
        info,
        params,
        notes,
    )

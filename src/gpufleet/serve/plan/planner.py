"""SLA capacity planner: candidate search, bisection of each shape's max rate, choice.

For every shape (aggregated: TP × max batch; disaggregated: prefill TP × decode TP × decode max
batch) the planner bisects the highest rate one instance sustains at the SLO (the discrete-event
simulation of :mod:`gpufleet.serve.plan.sim`; common random numbers, so latency is monotone in the
rate), sizes the replica counts for the target rate, then simulates the whole deployment at the
target rate and adjusts the counts (+1 on the phase that misses, then −1 while it still passes).
The choice is the fewest GPUs (lowest cost with a price), ties broken by the higher max rate.

This module holds the search and choice (:func:`plan`) and :func:`replan`; the data model is in
:mod:`gpufleet.serve.plan.model`, candidate generation in :mod:`gpufleet.serve.plan.shapes` and the
simulation-based evaluation and sizing in :mod:`gpufleet.serve.plan.evaluate` (their public names are
re-exported here).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from gpufleet.serve.common.plan_format import Mode
from gpufleet.serve.plan.evaluate import simulate, size_replicas, system_max_rate, verify
from gpufleet.serve.plan.model import Candidate, PlanOptions, PlanResult, pd_units
from gpufleet.serve.plan.profile import Profile
from gpufleet.serve.plan.shapes import aggregated_shapes, disaggregated_shapes
from gpufleet.serve.plan.traffic import Traffic

__all__ = [
    "PlanOptions",
    "Candidate",
    "PlanResult",
    "plan",
    "system_max_rate",
    "simulate",
    "replan",
    "pd_units",
]

_verify = verify  # the pre-split private name, used by benchmarks/bench_planner.py


def _key(c: Candidate, opts: PlanOptions) -> tuple[float, float]:
    return (float(c.gpus), -c.max_rate)


def _reason(c: Candidate, best: Candidate, opts: PlanOptions) -> str:
    if not c.feasible:
        return c.note or "misses the SLO"
    price = opts.price_per_gpu_hour
    if c.gpus > best.gpus:
        extra = f" (+${(c.gpus - best.gpus) * price:.2f}/h)" if price else ""
        return f"needs {c.gpus} GPUs vs {best.gpus}{extra}"
    return f"same {c.gpus} GPUs but less headroom: max {c.max_rate:.3g} vs {best.max_rate:.3g} req/s"


def plan(prof: Profile, traffic: Traffic, opts: PlanOptions, runners_up: int = 5) -> PlanResult:
    u = traffic.unit(opts.n_sim, opts.seed)
    cands: list[Candidate] = []
    if Mode.AGGREGATED in opts.modes:
        cands += aggregated_shapes(prof, traffic, opts, u)
    if Mode.DISAGGREGATED in opts.modes:
        cands += disaggregated_shapes(prof, traffic, opts, u)
    # size the most promising shapes at full scale (estimated GPUs from single-instance rates)
    est = sorted((c for c in cands if c.unit_rate > 0), key=lambda c: (c.gpus, -c.unit_rate))
    for i, c in enumerate(est):
        if i < opts.size_top:
            cands[cands.index(c)] = size_replicas(c, prof, traffic, opts)
        else:
            c.note = f"estimated {c.gpus} GPUs from 1 instance's max rate (not sized, rank > {opts.size_top})"
    for c in cands:
        if c.feasible and c.mode == Mode.DISAGGREGATED and pd_units(c, opts.domain_gpus) is None:
            c.feasible, c.note = False, f"no P/D unit fits one {opts.domain_gpus}-GPU NVLink domain"
    ok = [c for c in cands if c.feasible]
    ok.sort(key=lambda c: (c.gpus, -c.unit_rate))
    top = _dedupe(ok)[: runners_up + 1]
    for c in top:  # passed at the target rate, so at least that (bisection resolution aside)
        c.max_rate = max(system_max_rate(c, prof, traffic, opts), traffic.rate)
    if top:
        top.sort(key=lambda c: _key(c, opts))
        best = top[0]
        return PlanResult(best, True, cands, [(c, _reason(c, best, opts)) for c in top[1:]])
    closest = sorted(cands, key=lambda c: -float(c.eval.get("slack", -1e9)))
    if not closest:
        raise ValueError("no candidate shapes (no TP size fits the NVLink domain)")
    best = closest[0]
    return PlanResult(best, False, cands, [(c, _reason(c, best, opts)) for c in closest[1 : runners_up + 1]])


def _dedupe(cs: list[Candidate]) -> list[Candidate]:
    seen: set[str] = set()
    out = []
    for c in cs:
        if c.label() not in seen:
            seen.add(c.label())
            out.append(c)
    return out


def replan(current: Candidate, prof: Profile, window: Traffic, opts: PlanOptions) -> dict[str, Any]:
    """Is the current deployment still right for the observed window? For P/D: the best split of
    the same GPUs, else the smallest counts that pass (same TP sizes)."""
    now = verify(current, prof, window, opts)
    res: dict[str, Any] = {
        "current": current.label(),
        "gpus": current.gpus,
        "attainment_now": round(float(now["attainment"]), 4),
        "passes_now": bool(now["passed"]),
    }
    if current.mode == Mode.AGGREGATED:
        sized = size_replicas(replace(current, replicas=1), prof, window, opts)
        res.update(proposed=sized.label(), proposed_gpus=sized.gpus, feasible=sized.feasible)
        res["action"] = (
            "keep"
            if sized.replicas == current.replicas
            else ("scale-up" if sized.replicas > current.replicas else "scale-down")
        )
        return res
    best: tuple[float, Candidate] | None = None
    total = current.gpus
    for p in range(1, total // current.p_tp):
        d_gpus = total - p * current.p_tp
        if d_gpus < current.d_tp or d_gpus % current.d_tp:
            continue
        c = replace(current, p_replicas=p, d_replicas=d_gpus // current.d_tp)
        ev = verify(c, prof, window, opts)
        score = float(ev["attainment"]) + (1.0 if ev["passed"] else 0.0)
        if (
            best is None
            or score > best[0] + 1e-9
            or (abs(score - best[0]) <= 1e-9 and c.p_replicas == current.p_replicas)
        ):
            best = (score, replace(c, eval=ev))
    if best is not None and best[1].eval["passed"]:
        c = best[1]
        res.update(
            proposed=c.label(),
            proposed_gpus=c.gpus,
            feasible=True,
            attainment_proposed=round(float(c.eval["attainment"]), 4),
        )
        res["action"] = "keep" if c.p_replicas == current.p_replicas else "rebalance"
        if res["passes_now"] and res["action"] == "rebalance":
            res["action"] = "keep"  # the current split passes: do not move GPUs for nothing
            res["proposed"] = current.label()
        return res
    sized = size_replicas(replace(current, p_replicas=1, d_replicas=1), prof, window, opts)
    res.update(
        proposed=sized.label(),
        proposed_gpus=sized.gpus,
        feasible=sized.feasible,
        attainment_proposed=round(float(sized.eval.get("attainment", 0.0)), 4),
        action="scale-up" if sized.gpus > total else "rebalance",
    )
    return res

"""SLA capacity planner: candidate search, bisection of each shape's max rate, choice.

For every shape (aggregated: TP × max batch; disaggregated: prefill TP × decode TP × decode max
batch) the planner bisects the highest rate one instance sustains at the SLO (the discrete-event
simulation of :mod:`gpufleet.serve.sim`; common random numbers, so latency is monotone in the
rate), sizes the replica counts for the target rate, then simulates the whole deployment at the
target rate and adjusts the counts (+1 on the phase that misses, then −1 while it still passes).
The choice is the fewest GPUs (lowest cost with a price), ties broken by the higher max rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from gpufleet.serve.profile import Profile, TpProfile
from gpufleet.serve.sim import Requests, SimResult, Slo, evaluate, simulate_aggregated, simulate_disaggregated
from gpufleet.serve.traffic import Traffic

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

BATCHES = (8, 16, 32, 64, 128, 256, 512)


@dataclass(frozen=True)
class PlanOptions:
    slo: Slo
    domain_gpus: int = 8
    price_per_gpu_hour: float | None = None
    kv_gbps: float = 100.0  # P->D KV-cache transfer bandwidth, GB/s
    n_sim: int = 1500  # requests per single-instance simulation
    max_gpus: int = 1024
    modes: tuple[str, ...] = ("aggregated", "disaggregated")
    seed: int = 0
    rel_tol: float = 0.02
    size_top: int = 10  # shapes simulated at full scale (the rest keep their estimate)


@dataclass
class Candidate:
    mode: str
    tp: int = 0  # aggregated
    replicas: int = 0
    max_batch: int = 0
    p_tp: int = 0  # disaggregated
    p_replicas: int = 0
    p_batch: int = 0
    d_tp: int = 0
    d_replicas: int = 0
    d_batch: int = 0
    unit_rate: float = 0.0  # per-instance max rate (aggregated) or min of phases
    feasible: bool = False
    note: str = ""
    eval: dict[str, Any] = field(default_factory=dict)
    max_rate: float = 0.0

    @property
    def gpus(self) -> int:
        if self.mode == "aggregated":
            return self.tp * self.replicas
        return self.p_tp * self.p_replicas + self.d_tp * self.d_replicas

    def label(self) -> str:
        if self.mode == "aggregated":
            return f"agg {self.replicas}x(TP{self.tp}, batch {self.max_batch})"
        return (
            f"disagg {self.p_replicas}P(TP{self.p_tp}) + {self.d_replicas}D(TP{self.d_tp}, "
            f"batch {self.d_batch})"
        )

    def config(self) -> dict[str, Any]:
        if self.mode == "aggregated":
            return {
                "mode": self.mode,
                "tp": self.tp,
                "replicas": self.replicas,
                "max_batch": self.max_batch,
                "gpus": self.gpus,
            }
        return {
            "mode": self.mode,
            "prefill": {"tp": self.p_tp, "replicas": self.p_replicas, "max_batch": self.p_batch},
            "decode": {"tp": self.d_tp, "replicas": self.d_replicas, "max_batch": self.d_batch},
            "gpus": self.gpus,
        }


@dataclass
class PlanResult:
    chosen: Candidate
    feasible: bool
    candidates: list[Candidate]
    runners_up: list[tuple[Candidate, str]]


def pd_units(c: Candidate, domain_gpus: int) -> list[tuple[list[int], list[int]]] | None:
    """Split P and D instances into the fewest units (each ≥1 P and ≥1 D, spread evenly) that each
    fit one NVLink domain; None if no split fits."""
    lo = max(1, math.ceil(c.gpus / domain_gpus))
    for k in range(lo, min(c.p_replicas, c.d_replicas) + 1):
        units = [
            ([i for i in range(c.p_replicas) if i % k == j], [i for i in range(c.d_replicas) if i % k == j])
            for j in range(k)
        ]
        if all(len(p) * c.p_tp + len(d) * c.d_tp <= domain_gpus for p, d in units):
            return units
    return None


def simulate(c: Candidate, prof: Profile, req: Requests, kv_gbps: float) -> SimResult:
    if c.mode == "aggregated":
        return simulate_aggregated(req, prof.tps[c.tp], c.replicas, c.max_batch)
    return simulate_disaggregated(
        req,
        prof.tps[c.p_tp],
        c.p_replicas,
        c.p_batch,
        prof.tps[c.d_tp],
        c.d_replicas,
        c.d_batch,
        prof.kv_bytes_per_token,
        kv_gbps,
    )


def _bisect(passes: Any, guess: float, rel_tol: float) -> float:
    """Highest rate with ``passes(rate)``: doubling/halving from ``guess``, then bisection."""
    lo, hi = 0.0, guess
    for _ in range(40):
        if passes(hi):
            lo, hi = hi, hi * 2
        elif lo == 0.0 and hi > guess * 1e-4:
            hi /= 2
            if passes(hi):
                lo, hi = hi, hi * 2
                break
            continue
        else:
            break
    if lo == 0.0:
        return 0.0
    while hi - lo > rel_tol * lo:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if passes(mid) else (lo, mid)
    return lo


def _scaled(u: Requests, rate: float) -> Requests:
    return Requests(u.arrival / rate, u.inp, u.out)


def _guess(tp: TpProfile, li: float, lo: float) -> float:
    return 1000.0 / max(tp.prefill_ms(li, li * li) + lo * tp.decode_ms(li + lo / 2, 1), 1e-6)


def _phase_slo(slo: Slo, metric: str) -> Slo:
    return Slo({k: v for k, v in slo.limits.items() if k == metric}, slo.attainment)


def _system_requests(c: Candidate, traffic: Traffic, opts: PlanOptions) -> Requests:
    """The requests a whole deployment is judged on (same for its max rate and its check)."""
    n = min(max(opts.n_sim, 200 * (c.replicas or (c.p_replicas + c.d_replicas))), 20000)
    return traffic.unit(n, opts.seed + 1)


def system_max_rate(c: Candidate, prof: Profile, traffic: Traffic, opts: PlanOptions) -> float:
    """Max rate of the whole deployment at the SLO (bisection of full-system simulations)."""
    u = _system_requests(c, traffic, opts)
    guess = max(c.unit_rate, 1e-3) * max(c.replicas, c.p_replicas, 1)
    return _bisect(
        lambda r: bool(evaluate(simulate(c, prof, _scaled(u, r), opts.kv_gbps), opts.slo)["passed"]),
        guess,
        opts.rel_tol,
    )


def _verify(c: Candidate, prof: Profile, traffic: Traffic, opts: PlanOptions) -> dict[str, Any]:
    u = _system_requests(c, traffic, opts)
    res = simulate(c, prof, _scaled(u, traffic.rate), opts.kv_gbps)
    ev = evaluate(res, opts.slo)
    ev["ttft_ok"] = evaluate(res, _phase_slo(opts.slo, "ttft"))["passed"]
    ev["tpot_ok"] = evaluate(res, _phase_slo(opts.slo, "tpot"))["passed"]
    return ev


def _batches(tp: TpProfile) -> list[int]:
    if tp.max_batch <= 1:
        return [1]
    return sorted({b for b in BATCHES if b < tp.max_batch} | {tp.max_batch})


def _size(c: Candidate, prof: Profile, traffic: Traffic, opts: PlanOptions) -> Candidate:
    """Adjust replica counts until the full deployment passes at the target rate (or give up)."""
    agg = c.mode == "aggregated"
    tried: dict[tuple[int, int], dict[str, Any]] = {}

    def check(x: Candidate) -> dict[str, Any]:
        key = (x.replicas, x.p_replicas * 100000 + x.d_replicas)
        if key not in tried:
            tried[key] = _verify(x, prof, traffic, opts)
        return tried[key]

    for _ in range(30):
        if c.gpus > opts.max_gpus:
            return replace(c, feasible=False, note=f"needs more than --max-gpus {opts.max_gpus}")
        ev = check(c)
        if ev["passed"]:
            break
        if agg:
            c = replace(c, replicas=c.replicas + max(1, c.replicas // 8))
        elif not ev["ttft_ok"]:
            c = replace(c, p_replicas=c.p_replicas + max(1, c.p_replicas // 8))
        else:
            c = replace(c, d_replicas=c.d_replicas + max(1, c.d_replicas // 8))
    else:
        return replace(c, feasible=False, note="did not reach the SLO at the target rate", eval=ev)
    for attr in ("replicas",) if agg else ("d_replicas", "p_replicas"):
        while getattr(c, attr) > 1:
            smaller = replace(c, **{attr: getattr(c, attr) - 1})
            if not check(smaller)["passed"]:
                break
            c = smaller
    return replace(c, feasible=True, eval=check(c))


def _floor_note(c: Candidate, prof: Profile, traffic: Traffic, opts: PlanOptions) -> Candidate:
    """A shape that fails even at a trickle of traffic: evaluate it there, say which limit fails."""
    u = traffic.unit(min(opts.n_sim, 400), opts.seed)
    ev = evaluate(
        simulate(c, prof, _scaled(u, max(c.unit_rate, 1e-3, traffic.rate * 1e-3)), opts.kv_gbps), opts.slo
    )
    worst = [
        f"{m.upper()} p{q:g} {ev[m + '_ms'][f'p{int(q)}']:.0f} ms > {lim * 1000:.0f} ms"
        for m, (q, lim) in opts.slo.limits.items()
        if ev[m + "_ms"][f"p{int(q)}"] > lim * 1000
    ]
    note = "infeasible even at low load: " + ("; ".join(worst) or "attainment below target")
    return replace(c, feasible=False, note=note, eval=ev)


def _aggregated(prof: Profile, traffic: Traffic, opts: PlanOptions, u: Requests) -> list[Candidate]:
    li, lo = traffic.mean_lengths()
    out: list[Candidate] = []
    for tp in sorted(prof.tps.values(), key=lambda t: t.tp):
        if tp.tp > opts.domain_gpus:
            continue
        prev = -1.0
        for b in _batches(tp):
            r1 = _bisect(
                lambda r, t=tp, bb=b: bool(
                    evaluate(simulate_aggregated(_scaled(u, r), t, 1, bb), opts.slo)["passed"]
                ),
                _guess(tp, li, lo),
                opts.rel_tol,
            )
            c = Candidate("aggregated", tp=tp.tp, replicas=1, max_batch=b, unit_rate=r1)
            if r1 <= 0:
                out.append(_floor_note(c, prof, traffic, opts))
                continue
            if r1 <= prev * 1.01:  # a larger batch cap no longer helps
                break
            prev = r1
            c.replicas = max(1, math.ceil(traffic.rate / r1))
            out.append(c)
    return out


def _disaggregated(prof: Profile, traffic: Traffic, opts: PlanOptions, u: Requests) -> list[Candidate]:
    li, lo = traffic.mean_lengths()
    tps = [t for t in sorted(prof.tps.values(), key=lambda t: t.tp) if t.tp <= opts.domain_gpus]
    ttft_slo, tpot_slo = _phase_slo(opts.slo, "ttft"), _phase_slo(opts.slo, "tpot")
    zero_out = Requests(u.arrival, u.inp, np.ones_like(u.out))
    prefill: dict[int, float] = {}
    for tp in tps:
        prefill[tp.tp] = _bisect(
            lambda r, t=tp: bool(
                evaluate(
                    simulate_disaggregated(_scaled(zero_out, r), t, 1, t.max_batch, t, 1, 1, 0.0, 0.0),
                    ttft_slo,
                )["passed"]
            ),
            _guess(tp, li, 1),
            opts.rel_tol,
        )
    out: list[Candidate] = []
    fast_p = tps[-1]  # an ample prefill side (64 instances) while sizing the decode side
    for dtp in tps:
        prev = -1.0
        for b in _batches(dtp):
            rd = _bisect(
                lambda r, t=dtp, bb=b: bool(
                    evaluate(
                        simulate_disaggregated(
                            _scaled(u, r),
                            fast_p,
                            64,
                            fast_p.max_batch,
                            t,
                            1,
                            bb,
                            prof.kv_bytes_per_token,
                            opts.kv_gbps,
                        ),
                        tpot_slo,
                    )["passed"]
                ),
                _guess(dtp, 1, lo),
                opts.rel_tol,
            )
            if rd <= prev * 1.01:
                break
            prev = rd
            # the prefill TP needing the fewest prefill GPUs at this rate (ties: the smaller TP)
            ok_p = [t for t in tps if prefill[t.tp] > 0]
            best_p = (
                min(ok_p, key=lambda t: (math.ceil(traffic.rate / prefill[t.tp]) * t.tp, t.tp))
                if ok_p
                else tps[0]
            )
            for ptp in [best_p]:
                rp = prefill[ptp.tp]
                c = Candidate(
                    "disaggregated",
                    p_tp=ptp.tp,
                    p_replicas=1,
                    p_batch=ptp.max_batch,
                    d_tp=dtp.tp,
                    d_replicas=1,
                    d_batch=b,
                    unit_rate=min(rp, rd),
                )
                if rp <= 0 or rd <= 0:
                    out.append(_floor_note(c, prof, traffic, opts))
                    continue
                c.p_replicas = max(1, math.ceil(traffic.rate / rp))
                c.d_replicas = max(1, math.ceil(traffic.rate / rd))
                out.append(c)
    return out


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
    if "aggregated" in opts.modes:
        cands += _aggregated(prof, traffic, opts, u)
    if "disaggregated" in opts.modes:
        cands += _disaggregated(prof, traffic, opts, u)
    # size the most promising shapes at full scale (estimated GPUs from single-instance rates)
    est = sorted((c for c in cands if c.unit_rate > 0), key=lambda c: (c.gpus, -c.unit_rate))
    for i, c in enumerate(est):
        if i < opts.size_top:
            cands[cands.index(c)] = _size(c, prof, traffic, opts)
        else:
            c.note = f"estimated {c.gpus} GPUs from 1 instance's max rate (not sized, rank > {opts.size_top})"
    for c in cands:
        if c.feasible and c.mode == "disaggregated" and pd_units(c, opts.domain_gpus) is None:
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
    now = _verify(current, prof, window, opts)
    res: dict[str, Any] = {
        "current": current.label(),
        "gpus": current.gpus,
        "attainment_now": round(float(now["attainment"]), 4),
        "passes_now": bool(now["passed"]),
    }
    if current.mode == "aggregated":
        sized = _size(replace(current, replicas=1), prof, window, opts)
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
        ev = _verify(c, prof, window, opts)
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
    sized = _size(replace(current, p_replicas=1, d_replicas=1), prof, window, opts)
    res.update(
        proposed=sized.label(),
        proposed_gpus=sized.gpus,
        feasible=sized.feasible,
        attainment_proposed=round(float(sized.eval.get("attainment", 0.0)), 4),
        action="scale-up" if sized.gpus > total else "rebalance",
    )
    return res

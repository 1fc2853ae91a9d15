"""SLA capacity planner, evaluation: simulating a candidate deployment, bisecting its max rate at the
SLO, checking it at the target rate and sizing its replica counts until it passes.

Uses the discrete-event simulation of :mod:`gpufleet.serve.plan.sim` with common random numbers, so
latency is monotone in the rate.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from gpufleet.serve.common.plan_format import Mode
from gpufleet.serve.plan.model import Candidate, PlanOptions
from gpufleet.serve.plan.profile import Profile, TpProfile
from gpufleet.serve.plan.sim import (
    Requests,
    SimResult,
    evaluate,
    simulate_aggregated,
    simulate_disaggregated,
)
from gpufleet.serve.plan.traffic import Traffic


def simulate(c: Candidate, prof: Profile, req: Requests, kv_gbps: float) -> SimResult:
    if c.mode == Mode.AGGREGATED:
        return simulate_aggregated(req, prof.tps[c.tp], c.replicas, c.max_batch, c.chunk)
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


def bisect_max_rate(passes: Any, guess: float, rel_tol: float) -> float:
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


def scaled(u: Requests, rate: float) -> Requests:
    return Requests(u.arrival / rate, u.inp, u.out)


def initial_guess(tp: TpProfile, li: float, lo: float) -> float:
    return 1000.0 / max(tp.prefill_ms(li, li * li) + lo * tp.decode_ms(li + lo / 2, 1), 1e-6)


def _system_requests(c: Candidate, traffic: Traffic, opts: PlanOptions) -> Requests:
    """The requests a whole deployment is judged on (same for its max rate and its check)."""
    n = min(max(opts.n_sim, 200 * (c.replicas or (c.p_replicas + c.d_replicas))), 20000)
    return traffic.unit(n, opts.seed + 1)


def system_max_rate(c: Candidate, prof: Profile, traffic: Traffic, opts: PlanOptions) -> float:
    """Max rate of the whole deployment at the SLO (bisection of full-system simulations)."""
    u = _system_requests(c, traffic, opts)
    guess = max(c.unit_rate, 1e-3) * max(c.replicas, c.p_replicas, 1)
    return bisect_max_rate(
        lambda r: bool(evaluate(simulate(c, prof, scaled(u, r), opts.kv_gbps), opts.slo)["passed"]),
        guess,
        opts.rel_tol,
    )


def verify(c: Candidate, prof: Profile, traffic: Traffic, opts: PlanOptions) -> dict[str, Any]:
    u = _system_requests(c, traffic, opts)
    res = simulate(c, prof, scaled(u, traffic.rate), opts.kv_gbps)
    ev = evaluate(res, opts.slo)
    ev["ttft_ok"] = evaluate(res, opts.slo.only("ttft"))["passed"]
    ev["tpot_ok"] = evaluate(res, opts.slo.only("tpot"))["passed"]
    return ev


def size_replicas(c: Candidate, prof: Profile, traffic: Traffic, opts: PlanOptions) -> Candidate:
    """Adjust replica counts until the full deployment passes at the target rate (or give up)."""
    agg = c.mode == Mode.AGGREGATED
    tried: dict[tuple[int, int], dict[str, Any]] = {}

    def check(x: Candidate) -> dict[str, Any]:
        key = (x.replicas, x.p_replicas * 100000 + x.d_replicas)
        if key not in tried:
            tried[key] = verify(x, prof, traffic, opts)
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


def floor_note(c: Candidate, prof: Profile, traffic: Traffic, opts: PlanOptions) -> Candidate:
    """A shape that fails even at a trickle of traffic: evaluate it there, say which limit fails."""
    u = traffic.unit(min(opts.n_sim, 400), opts.seed)
    ev = evaluate(
        simulate(c, prof, scaled(u, max(c.unit_rate, 1e-3, traffic.rate * 1e-3)), opts.kv_gbps), opts.slo
    )
    pct = {m: (f"p{opts.slo.percentile(m):g}", lim.seconds * 1000) for m, lim in opts.slo.limits.items()}
    worst = [
        f"{m.upper()} {q} {ev[m + '_ms'][q]:.0f} ms > {lim_ms:.0f} ms"
        for m, (q, lim_ms) in pct.items()
        if ev[m + "_ms"][q] > lim_ms
    ]
    note = "infeasible even at low load: " + ("; ".join(worst) or "attainment below target")
    return replace(c, feasible=False, note=note, eval=ev)

"""SLA capacity planner, candidate generation: the aggregated (TP x max batch) and disaggregated
(prefill TP x decode TP x decode batch) shapes, each with its one-instance max rate and estimated
replica counts for the target rate."""

from __future__ import annotations

import math

import numpy as np

from gpufleet.serve.common.plan_format import Mode
from gpufleet.serve.plan.evaluate import bisect_max_rate, floor_note, initial_guess, scaled
from gpufleet.serve.plan.model import Candidate, PlanOptions
from gpufleet.serve.plan.profile import Profile, TpProfile
from gpufleet.serve.plan.sim import Requests, evaluate, simulate_aggregated, simulate_disaggregated
from gpufleet.serve.plan.traffic import Traffic

BATCHES = (8, 16, 32, 64, 128, 256, 512)


def _batches(tp: TpProfile) -> list[int]:
    if tp.max_batch <= 1:
        return [1]
    return sorted({b for b in BATCHES if b < tp.max_batch} | {tp.max_batch})


def aggregated_shapes(prof: Profile, traffic: Traffic, opts: PlanOptions, u: Requests) -> list[Candidate]:
    li, lo = traffic.mean_lengths()
    out: list[Candidate] = []
    for tp in sorted(prof.tps.values(), key=lambda t: t.tp):
        if tp.tp > opts.domain_gpus:
            continue
        prev = -1.0
        for b in _batches(tp):
            r1 = bisect_max_rate(
                lambda r, t=tp, bb=b: bool(
                    evaluate(simulate_aggregated(scaled(u, r), t, 1, bb, opts.chunked_prefill), opts.slo)[
                        "passed"
                    ]
                ),
                initial_guess(tp, li, lo),
                opts.rel_tol,
            )
            c = Candidate(
                Mode.AGGREGATED, tp=tp.tp, replicas=1, max_batch=b, chunk=opts.chunked_prefill, unit_rate=r1
            )
            if r1 <= 0:
                out.append(floor_note(c, prof, traffic, opts))
                continue
            if r1 <= prev * 1.01:  # a larger batch cap no longer helps
                break
            prev = r1
            c.replicas = max(1, math.ceil(traffic.rate / r1))
            out.append(c)
    return out


def disaggregated_shapes(prof: Profile, traffic: Traffic, opts: PlanOptions, u: Requests) -> list[Candidate]:
    li, lo = traffic.mean_lengths()
    tps = [t for t in sorted(prof.tps.values(), key=lambda t: t.tp) if t.tp <= opts.domain_gpus]
    ttft_slo, tpot_slo = opts.slo.only("ttft"), opts.slo.only("tpot")
    zero_out = Requests(u.arrival, u.inp, np.ones_like(u.out))
    prefill: dict[int, float] = {}
    for tp in tps:
        prefill[tp.tp] = bisect_max_rate(
            lambda r, t=tp: bool(
                evaluate(
                    simulate_disaggregated(scaled(zero_out, r), t, 1, t.max_batch, t, 1, 1, 0.0, 0.0),
                    ttft_slo,
                )["passed"]
            ),
            initial_guess(tp, li, 1),
            opts.rel_tol,
        )
    out: list[Candidate] = []
    fast_p = tps[-1]  # an ample prefill side (64 instances) while sizing the decode side
    for dtp in tps:
        prev = -1.0
        for b in _batches(dtp):
            rd = bisect_max_rate(
                lambda r, t=dtp, bb=b: bool(
                    evaluate(
                        simulate_disaggregated(
                            scaled(u, r),
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
                initial_guess(dtp, 1, lo),
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
                    Mode.DISAGGREGATED,
                    p_tp=ptp.tp,
                    p_replicas=1,
                    p_batch=ptp.max_batch,
                    d_tp=dtp.tp,
                    d_replicas=1,
                    d_batch=b,
                    unit_rate=min(rp, rd),
                )
                if rp <= 0 or rd <= 0:
                    out.append(floor_note(c, prof, traffic, opts))
                    continue
                c.p_replicas = max(1, math.ceil(traffic.rate / rp))
                c.d_replicas = max(1, math.ceil(traffic.rate / rd))
                out.append(c)
    return out

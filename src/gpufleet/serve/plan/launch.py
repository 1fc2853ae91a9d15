"""What a plan turns into: placement groups, the plan file (docs/serve-plan.md, read by
``serve pack``), vLLM launch arguments and a disaggregated prefill/decode deployment description,
and the Pareto plot (GPUs against SLO slack)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpufleet.core.errors import UsageError
from gpufleet.core.paths import read_json
from gpufleet.serve.common.plan_format import PLAN_SCHEMA, PLAN_VERSION, Mode
from gpufleet.serve.plan.planner import Candidate, PlanOptions, PlanResult, pd_units
from gpufleet.serve.plan.profile import Profile
from gpufleet.serve.plan.traffic import Traffic

__all__ = [
    "pd_units",
    "groups",
    "launch",
    "plan_document",
    "candidate_from_plan",
    "pareto_png",
]


def groups(c: Candidate, domain_gpus: int) -> list[dict[str, Any]]:
    if c.mode == Mode.AGGREGATED:
        return [
            {"id": f"r{i}", "role": "replica", "tp": c.tp, "gpus": c.tp, "pd_group": None}
            for i in range(c.replicas)
        ]
    # an infeasible plan's closest candidate may not fit one domain: then it is one unit
    units = pd_units(c, domain_gpus) or [(list(range(c.p_replicas)), list(range(c.d_replicas)))]
    out: list[dict[str, Any]] = []
    for j, (ps, ds) in enumerate(units):
        out += [
            {"id": f"p{i}", "role": "prefill", "tp": c.p_tp, "gpus": c.p_tp, "pd_group": f"pd{j}"} for i in ps
        ]
        out += [
            {"id": f"d{i}", "role": "decode", "tp": c.d_tp, "gpus": c.d_tp, "pd_group": f"pd{j}"} for i in ds
        ]
    return out


def _vllm(
    model: str, tp: int, batch: int, tokens: int, extra: list[str] | None = None, chunked: bool = False
) -> list[str]:
    return [
        "vllm",
        "serve",
        model,
        "--tensor-parallel-size",
        str(tp),
        "--max-num-seqs",
        str(batch),
        "--max-num-batched-tokens",
        str(tokens),
        "--enable-chunked-prefill" if chunked else "--no-enable-chunked-prefill",
        *(extra or []),
    ]


def launch(c: Candidate, prof: Profile, domain_gpus: int) -> dict[str, Any]:
    """vLLM arguments (aggregated: one command per replica) or a P/D deployment description."""
    if c.mode == Mode.AGGREGATED:
        tokens = c.chunk or prof.tps[c.tp].prefill_max_tokens
        return {
            "vllm_args": _vllm(prof.model, c.tp, c.max_batch, tokens, chunked=c.chunk > 0),
            "replicas": c.replicas,
            "router": "any least-loaded / round-robin HTTP load balancer over the replicas",
        }
    kv = ["--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"})]
    units = pd_units(c, domain_gpus) or []
    return {
        "deployment": {
            "kind": "prefill-decode-disaggregated",
            "engine": "vLLM with NixlConnector (KV cache moved prefill -> decode over NVLink/RDMA)",
            "prefill": {
                "replicas": c.p_replicas,
                "tp": c.p_tp,
                "args": _vllm(prof.model, c.p_tp, c.p_batch, prof.tps[c.p_tp].prefill_max_tokens, kv),
            },
            "decode": {
                "replicas": c.d_replicas,
                "tp": c.d_tp,
                "args": _vllm(prof.model, c.d_tp, c.d_batch, prof.tps[c.d_tp].prefill_max_tokens, kv),
            },
            "router": "P/D-aware proxy: send each request to a prefill worker with max_tokens=1, then to a "
            "decode worker of the same pd_group with the KV-transfer handle (vLLM's disaggregated "
            "proxy example, or NVIDIA Dynamo's frontend)",
            "pd_groups": [
                {"id": f"pd{j}", "prefill": len(p), "decode": len(d)} for j, (p, d) in enumerate(units)
            ],
            "note": "each pd_group must stay in one NVLink domain (see groups in plan.json)",
        }
    }


def _rnd(d: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 2) for k, v in d.items()}


def plan_document(
    res: PlanResult,
    prof: Profile,
    traffic: Traffic,
    opts: PlanOptions,
    workload: str,
    domain: dict[str, Any],
) -> dict[str, Any]:
    c = res.chosen
    price = opts.price_per_gpu_hour
    ev = c.eval
    grp = groups(c, opts.domain_gpus)
    return {
        "schema": PLAN_SCHEMA,
        "version": PLAN_VERSION,
        "workload": workload,
        "feasible": res.feasible,
        "config": c.config(),
        "gpus": c.gpus,
        "groups": grp,
        "pd_groups": len({g["pd_group"] for g in grp if g["pd_group"]}),
        "domain": domain,
        "price_per_gpu_hour": price,
        "cost_per_hour": round(c.gpus * price, 4) if price else None,
        "slo": {
            **{
                f"{m}_p{opts.slo.percentile(m):g}_ms": round(lim.seconds * 1000, 3)
                for m, lim in opts.slo.limits.items()
            },
            "attainment": opts.slo.attainment,
        },
        "traffic": traffic.describe(),
        "predicted": {
            "max_rate_per_s": round(c.max_rate, 4),
            "goodput_per_gpu": round(c.max_rate / c.gpus, 4) if c.gpus else 0.0,
            "attainment": round(float(ev.get("attainment", 0.0)), 4),
            "ttft_ms": _rnd(ev.get("ttft_ms", {})),
            "tpot_ms": _rnd(ev.get("tpot_ms", {})),
        },
        "profile": {"model": prof.model, "hardware": prof.hardware, "path": prof.path, "source": prof.source},
        "runners_up": [
            {
                "config": r.config(),
                "label": r.label(),
                "gpus": r.gpus,
                "cost_per_hour": round(r.gpus * price, 4) if price else None,
                "max_rate_per_s": round(r.max_rate, 4),
                "reason": why,
            }
            for r, why in res.runners_up
        ],
        "launch": launch(c, prof, opts.domain_gpus),
    }


def candidate_from_plan(path: Path) -> tuple[Candidate, dict[str, Any]]:
    """The chosen configuration of a plan file (for ``--replan``)."""
    doc = read_json(path, "plan file")
    if not isinstance(doc, dict) or doc.get("schema") != PLAN_SCHEMA or doc.get("version") != PLAN_VERSION:
        raise UsageError(f"plan {path.name}: not a {PLAN_SCHEMA} version {PLAN_VERSION} file")
    cfg = doc.get("config") or {}
    try:
        if cfg["mode"] == Mode.AGGREGATED:
            c = Candidate(
                Mode.AGGREGATED,
                tp=int(cfg["tp"]),
                replicas=int(cfg["replicas"]),
                max_batch=int(cfg["max_batch"]),
                chunk=int(cfg.get("chunked_prefill", 0)),  # absent in plans written before it existed
            )
        else:
            p, d = cfg["prefill"], cfg["decode"]
            c = Candidate(
                Mode.DISAGGREGATED,
                p_tp=int(p["tp"]),
                p_replicas=int(p["replicas"]),
                p_batch=int(p["max_batch"]),
                d_tp=int(d["tp"]),
                d_replicas=int(d["replicas"]),
                d_batch=int(d["max_batch"]),
            )
    except (KeyError, TypeError, ValueError):
        raise UsageError(f"plan {path.name}: config is incomplete") from None
    return c, doc


def pareto_png(res: PlanResult, path: Path, title: str) -> None:
    """GPUs (x) against SLO slack at the target rate (y: 1 − worst percentile/limit)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [(c.gpus, float(c.eval["slack"]), c) for c in res.candidates if "slack" in c.eval and c.gpus]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, color in ((Mode.AGGREGATED, "tab:blue"), (Mode.DISAGGREGATED, "tab:orange")):
        xs = [(g, s) for g, s, c in pts if c.mode == mode]
        if xs:
            ax.scatter([g for g, _ in xs], [max(s, -1.0) for _, s in xs], c=color, label=mode, alpha=0.7)
    front, best = [], -1e9
    for g, s, _ in sorted(pts, key=lambda p: (p[0], -p[1])):
        if s > best:
            front.append((g, max(s, -1.0)))
            best = s
    if front:
        ax.plot([g for g, _ in front], [s for _, s in front], "k--", lw=1, label="Pareto front")
    ch = res.chosen
    if "slack" in ch.eval:
        ax.scatter(
            [ch.gpus],
            [max(float(ch.eval["slack"]), -1.0)],
            s=160,
            facecolors="none",
            edgecolors="red",
            label=f"chosen: {ch.label()}",
        )
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("SLO slack at target rate (1 - p/limit, worst metric)")
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

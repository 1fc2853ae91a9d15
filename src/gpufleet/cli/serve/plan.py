"""``gpufleet serve plan`` (docs/serve-plan.md).

``register(app)`` adds the command to the ``serve`` group. Thin: parse flags (bad values are one-line
UsageErrors, exit 2), call :mod:`gpufleet.serve.plan`, render. numpy, the simulator and matplotlib
load inside the command.
"""

from __future__ import annotations

import json
import math
import shlex
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from gpufleet.core.errors import UsageError
from gpufleet.core.exitcodes import ExitCode

__all__ = ["register", "plan_command"]

Opt = typer.Option


def register(app: typer.Typer) -> None:
    app.command("plan")(plan_command)


def _domain(gpus_per_node: int | None, rack: str | None) -> dict[str, Any]:
    from gpufleet.serve.common.racks import rack_type

    if rack is not None and gpus_per_node is not None:
        raise UsageError("give --gpus-per-node or --rack, not both")
    if rack is not None:
        rt = rack_type(rack, flag="--rack")
        return {"kind": str(rt.kind), "gpus": rt.gpus, "name": rt.name}
    g = 8 if gpus_per_node is None else gpus_per_node
    if g < 1:
        raise UsageError(f"--gpus-per-node must be >= 1 (got {g})")
    return {"kind": "node", "gpus": g, "name": f"node{g}"}


def _fmt_pct(d: dict[str, float]) -> str:
    return " ".join(f"{k} {v:.0f}" if v >= 10 else f"{k} {v:.2f}" for k, v in d.items())


def plan_command(
    profile: Annotated[
        str, Opt("--profile", help="Profile file, or a shipped example name (serve profile --list).")
    ],
    traffic: Annotated[
        str | None,
        Opt(
            "--traffic",
            help="rate=12;in=lognormal:512,0.6;out=fixed:128;cv=1, a .json, or a Mooncake .jsonl.",
        ),
    ] = None,
    slo: Annotated[
        str, Opt("--slo", help="ttft_p90=500ms,tpot_p90=50ms (a plain ttft=500ms is judged at p90).")
    ] = "ttft_p90=500ms,tpot_p90=50ms",
    attainment: Annotated[float, Opt("--attainment", help="Share of requests meeting every limit.")] = 0.9,
    gpus_per_node: Annotated[
        int | None, Opt("--gpus-per-node", help="NVLink domain = one node of N GPUs (default 8).")
    ] = None,
    rack: Annotated[
        str | None, Opt("--rack", help="NVLink domain = one rack or node type: nvl72, nvl36, hgx8.")
    ] = None,
    price: Annotated[
        float | None, Opt("--price-per-gpu-hour", help="Report cost; choose the lowest cost.")
    ] = None,
    kv_gbps: Annotated[float, Opt("--kv-gbps", help="P->D KV-cache transfer bandwidth, GB/s.")] = 100.0,
    chunked_prefill: Annotated[
        int,
        Opt(
            "--chunked-prefill",
            help="Aggregated engines chunk prefills with this token budget per iteration (vLLM V1 "
            "style; 0 = whole prompts first, as DistServe's vLLM did).",
        ),
    ] = 0,
    mode: Annotated[str, Opt("--mode", help="both | aggregated | disaggregated")] = "both",
    rate: Annotated[float | None, Opt("--rate", help="Override the traffic's rate (req/s).")] = None,
    name: Annotated[str | None, Opt("--name", help="Workload name in plan.json.")] = None,
    out: Annotated[
        Path | None, Opt("--out", help="Folder for plan.json, candidates.json, pareto.png.")
    ] = None,
    sim_requests: Annotated[
        int, Opt("--sim-requests", help="Requests per single-instance simulation.")
    ] = 1500,
    max_gpus: Annotated[int, Opt("--max-gpus", help="Largest deployment considered.")] = 1024,
    replan_flag: Annotated[
        bool, Opt("--replan", help="Re-plan a running deployment for a new window.")
    ] = False,
    current: Annotated[Path | None, Opt("--current", help="--replan: the current plan.json.")] = None,
    window: Annotated[
        str | None, Opt("--window", help="--replan: the observed traffic (spec or trace).")
    ] = None,
    as_json: Annotated[bool, Opt("--json", help="Print the plan (or replan) as JSON.")] = False,
    seed: Annotated[int, Opt("--seed")] = 0,
) -> None:
    """Plan GPUs for a traffic pattern and SLO: aggregated vs disaggregated P/D, TP, batch, replicas."""
    from gpufleet.core.paths import output_dir
    from gpufleet.serve.common.plan_format import Mode
    from gpufleet.serve.common.slo import parse_slo
    from gpufleet.serve.plan import launch as lm
    from gpufleet.serve.plan import planner as pl
    from gpufleet.serve.plan.profile import load_profile
    from gpufleet.serve.plan.traffic import load_traffic

    if price is not None and not (math.isfinite(price) and price >= 0):
        raise UsageError(f"--price-per-gpu-hour must be >= 0 (got {price:g})")
    if not kv_gbps > 0 or sim_requests < 100 or max_gpus < 1:
        raise UsageError("--kv-gbps must be > 0, --sim-requests >= 100, --max-gpus >= 1")
    if chunked_prefill < 0 or 0 < chunked_prefill < 64:
        raise UsageError(f"--chunked-prefill must be 0 (off) or >= 64 tokens (got {chunked_prefill})")
    modes = {"both": tuple(Mode), **{m.value: (m,) for m in Mode}}.get(mode.strip().lower())
    if modes is None:
        raise UsageError(f"--mode must be both, aggregated or disaggregated (got {mode!r})")
    dom = _domain(gpus_per_node, rack)
    slo_obj = parse_slo(slo, metrics=("ttft", "tpot"), attainment=attainment)
    if not slo_obj:
        raise UsageError("--slo needs at least one of ttft_p90=..., tpot_p90=...")
    if out is not None:
        output_dir(out, "--out")
    prof = load_profile(profile)
    opts = pl.PlanOptions(
        slo_obj,
        dom["gpus"],
        price,
        kv_gbps,
        sim_requests,
        max_gpus,
        modes,
        seed,
        chunked_prefill=chunked_prefill,
    )
    if replan_flag:
        if current is None or window is None:
            raise UsageError("--replan needs --current PLAN.json and --window TRAFFIC")
        cur, _ = lm.candidate_from_plan(current)
        for t in {cur.tp, cur.p_tp, cur.d_tp} - {0}:
            if t not in prof.tps:
                raise UsageError(f"the profile has no TP{t} entry needed by {current.name}")
        res = pl.replan(cur, prof, load_traffic(window, rate), opts)
        typer.echo(
            json.dumps(res, indent=2)
            if as_json
            else f"{res['action']}: now {res['current']} (attainment {res['attainment_now']:.1%}) -> "
            f"{res['proposed']} ({res['proposed_gpus']} GPUs)"
        )
        return
    if traffic is None:
        raise UsageError("--traffic is required (rate=..;in=..;out=..;cv=.., a .json or a Mooncake .jsonl)")
    tr = load_traffic(traffic, rate)
    result = pl.plan(prof, tr, opts)
    workload = name or (Path(traffic).stem if traffic.endswith((".json", ".jsonl")) else "workload")
    doc = lm.plan_document(result, prof, tr, opts, workload, dom)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "plan.json").write_text(json.dumps(doc, indent=2) + "\n")
        (out / "candidates.json").write_text(
            json.dumps(
                [
                    {
                        "label": c.label(),
                        "config": c.config(),
                        "feasible": c.feasible,
                        "unit_rate": c.unit_rate,
                        "max_rate": c.max_rate,
                        "note": c.note,
                        "eval": c.eval,
                    }
                    for c in result.candidates
                ],
                indent=1,
                default=float,
            )
            + "\n"
        )
        try:
            lm.pareto_png(result, out / "pareto.png", f"{workload}: {prof.model} on {prof.hardware}")
        except ImportError:
            typer.echo(
                "pareto.png skipped: matplotlib is not installed (pip install 'gpufleet[plot]')", err=True
            )
    if as_json:
        typer.echo(json.dumps(doc, indent=2))
    else:
        _render(doc, result.chosen.label(), out)
    if not result.feasible:
        raise SystemExit(ExitCode.FAILED)  # infeasible


def _render(doc: dict[str, Any], label: str, out: Path | None) -> None:
    p = doc["predicted"]
    tr = doc["traffic"]
    if not doc["feasible"]:
        typer.echo(
            f"INFEASIBLE: no candidate meets the SLO {doc['slo']} at {tr['rate_per_s']:g} req/s.", err=True
        )
        typer.echo(
            f"closest: {label} ({doc['gpus']} GPUs): TTFT ms {_fmt_pct(p['ttft_ms'])}; "
            f"TPOT ms {_fmt_pct(p['tpot_ms'])}; attainment {p['attainment']:.1%}"
        )
    else:
        cost = f", ${doc['cost_per_hour']:.2f}/h" if doc["cost_per_hour"] is not None else ""
        typer.echo(
            f"plan for {doc['workload']} at {tr['rate_per_s']:g} req/s: {label} = {doc['gpus']} GPUs{cost}"
        )
        typer.echo(
            f"  predicted at that rate: TTFT ms {_fmt_pct(p['ttft_ms'])}; TPOT ms {_fmt_pct(p['tpot_ms'])}; "
            f"attainment {p['attainment']:.1%}"
        )
        typer.echo(
            f"  max rate at the SLO {p['max_rate_per_s']:.3g} req/s; "
            f"goodput {p['goodput_per_gpu']:.3g} req/s/GPU"
        )
    for r in doc["runners_up"]:
        typer.echo(f"  runner-up: {r['label']}: {r['reason']}")
    launch = doc["launch"]
    if "vllm_args" in launch:
        typer.echo(f"  launch ({launch['replicas']}x): {shlex.join(launch['vllm_args'])}")
    else:
        d = launch["deployment"]
        typer.echo(f"  prefill ({d['prefill']['replicas']}x): {shlex.join(d['prefill']['args'])}")
        typer.echo(f"  decode  ({d['decode']['replicas']}x): {shlex.join(d['decode']['args'])}")
    if out is not None:
        typer.echo(f"  files: {out / 'plan.json'}, {out / 'candidates.json'}, {out / 'pareto.png'}")
    sys.stdout.flush()

"""P7 planner benchmarks -> benchmarks/results/p7_planner.json.

1. **Prediction error** on the real llama.cpp server (SmolLM2-135M, CPU): profile it with
   ``serve profile``'s sweep, plan one instance for an SLO, run ``serve bench`` (Poisson) at the
   planned operating rate, compare measured p90 TTFT/TPOT with (a) the plan's prediction (the DES
   on its own sampled arrivals) and (b) the DES replaying the bench's exact send times.
2. **Simulation**: on DistServe-like workloads (published-derived OPT-13B/A100 profile; chatbot-like
   lengths), goodput per GPU (max rate at ≥90% attainment / GPUs, DistServe's definition) of the
   planned configuration vs a naive aggregated baseline: vLLM-default shape (TP1, max batch 256)
   sized by peak throughput (replicas = ceil(rate / saturated request throughput)).

    .venv/bin/python benchmarks/bench_planner.py [--skip-llama] [--url http://127.0.0.1:PORT/v1]
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/support: LlamaServer

import numpy as np  # noqa: E402

from gpufleet.serve.common.slo import SLO  # noqa: E402
from gpufleet.serve.plan import planner as pl  # noqa: E402
from gpufleet.serve.plan import profile as pm  # noqa: E402
from gpufleet.serve.plan.sim import Requests, evaluate, simulate_aggregated  # noqa: E402
from gpufleet.serve.plan.traffic import parse_traffic  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
VALIDATION_WORKLOAD = "in=fixed:48;out=fixed:24"


def validate(
    url: str, model: str, work: Path, *, requests: int = 40, utilisation: float = 0.6, seed: int = 1
) -> dict[str, Any]:
    """Profile -> plan -> bench at the planned rate -> compare p90s. Returns the figures."""
    t0 = time.perf_counter()
    pre, dec, mb = pm.measure(
        url,
        model,
        inputs=[16, 48, 96, 160],
        decode_inputs=[16, 96],
        output=24,
        concurrency=[1, 2],
        requests=3,
    )
    pc, pi = pm.fit_prefill(pre)
    dc, di = pm.fit_decode(dec)
    tp = pm.TpProfile(1, pc, dc, mb, 0, 8192, {"prefill": pi, "decode": di})
    prof = pm.Profile(model, "cpu", "measured", f"measured at {url}", {1: tp})
    prof.save(work / "profile.json")
    profile_s = time.perf_counter() - t0
    # SLO: TTFT p90 = 4x a lone request's TTFT, TPOT p90 = 1.5x a lone step: room for queueing
    lone = tp.prefill_ms(48, 48 * 48) / 1000.0
    step = tp.decode_ms(48 + 12, 1) / 1000.0
    slo = SLO.of(ttft=4 * lone, tpot=1.5 * step, percentile=90, attainment=0.9)
    tr = parse_traffic(f"rate=0.1;{VALIDATION_WORKLOAD};cv=1")
    opts = pl.PlanOptions(slo, modes=("aggregated",), n_sim=3000)
    res = pl.plan(prof, tr, opts)
    one = pl.Candidate("aggregated", tp=1, replicas=1, max_batch=mb, unit_rate=res.chosen.unit_rate)
    max_rate = pl.system_max_rate(one, prof, tr, opts)
    rate = round(utilisation * max_rate, 4)
    u = tr.unit(3000, 7)
    ev = evaluate(simulate_aggregated(Requests(u.arrival / rate, u.inp, u.out), tp, 1, mb), slo)
    out = work / "bench"
    cmd = [
        sys.executable,
        "-m",
        "gpufleet.cli.main",
        "serve",
        "bench",
        "--url",
        url,
        "--model",
        model,
        "--workload",
        VALIDATION_WORKLOAD,
        "--rate",
        str(rate),
        "--arrival",
        "poisson",
        "--requests",
        str(requests + 2),
        "--warmup",
        "2",
        "--seed",
        str(seed),
        "--out",
        str(out),
        "--no-plot",
        "--no-progress",
        "--json",
    ]
    t1 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"serve bench failed: {proc.stderr.strip()[-500:]}")
    bench_s = time.perf_counter() - t1
    s = json.loads((out / "summary.json").read_text())
    rows = [r for r in csv.DictReader((out / "requests.csv").open()) if r["warmup"] == "0" and not r["error"]]
    arr = np.array(sorted(float(r["intended_s"]) for r in rows))
    n = len(arr)
    rep = simulate_aggregated(Requests(arr - arr[0], np.full(n, 48), np.full(n, 24)), tp, 1, mb)
    measured = {"ttft_p90_ms": s["latency_ms"]["ttft"]["p90"], "tpot_p90_ms": s["latency_ms"]["tpot"]["p90"]}
    plan_pred = {"ttft_p90_ms": ev["ttft_ms"]["p90"], "tpot_p90_ms": ev["tpot_ms"]["p90"]}
    replay = {
        "ttft_p90_ms": float(np.percentile(rep.ttft, 90)) * 1000,
        "tpot_p90_ms": float(np.percentile(rep.tpot, 90)) * 1000,
    }

    def err(pred: dict[str, float]) -> dict[str, float]:
        return {k: round((pred[k] - measured[k]) / measured[k], 4) for k in measured}

    return {
        "server": {"url": url, "model": model, "max_batch": mb},
        "profile": {"prefill": vars(pc), "decode": vars(dc), "fit": tp.fit, "profile_s": round(profile_s, 1)},
        "slo_ms": {
            "ttft_p90": round(slo.ttft * 1000, 1),
            "tpot_p90": round(slo.tpot * 1000, 2),
        },
        "planned_max_rate_per_s": round(max_rate, 4),
        "bench_rate_per_s": rate,
        "utilisation": utilisation,
        "requests_measured": n,
        "bench_s": round(bench_s, 1),
        "measured": measured,
        "predicted_plan": plan_pred,
        "predicted_replay": replay,
        "rel_error_plan": err(plan_pred),
        "rel_error_replay": err(replay),
        "measured_attainment": s["slo"]["attainment"] if s["slo"]["attainment"] is not None else None,
        "predicted_attainment": round(float(ev["attainment"]), 4),
    }


def _peak_throughput(prof: pm.Profile, tr: Any, tp: int, batch: int, chunk: int = 0) -> float:
    """Saturated request throughput of one instance (every request arrives at t=0)."""
    u = tr.unit(1500, 3)
    r = simulate_aggregated(Requests(np.zeros(len(u.inp)), u.inp, u.out), prof.tps[tp], 1, batch, chunk)
    return len(u.inp) / r.end


def simulation_case(
    name: str, profile: str, traffic: str, ttft_s: float, tpot_s: float, chunk: int = 0
) -> dict[str, Any]:
    """``chunk`` > 0: aggregated engines (the plan's and the naive baseline's) use chunked prefill."""
    prof = pm.load_profile(profile)
    tr = parse_traffic(traffic)
    opts = pl.PlanOptions(
        SLO.of(ttft=ttft_s, tpot=tpot_s, percentile=90, attainment=0.9), n_sim=1500, chunked_prefill=chunk
    )
    t0 = time.perf_counter()
    res = pl.plan(prof, tr, opts)
    plan_s = time.perf_counter() - t0
    c = res.chosen
    peak = _peak_throughput(prof, tr, 1, 256, chunk)
    naive = pl.Candidate(
        "aggregated",
        tp=1,
        replicas=max(1, math.ceil(tr.rate / peak)),
        max_batch=256,
        chunk=chunk,
        unit_rate=peak,
    )
    naive_rate = pl.system_max_rate(naive, prof, tr, opts)
    naive_eval = pl._verify(naive, prof, tr, opts)
    g_plan = c.max_rate / c.gpus
    g_naive = naive_rate / naive.gpus
    # The other reading of "goodput": requests meeting both SLOs per second, at the target rate.
    at_target_plan = tr.rate * float(c.eval["attainment"]) / c.gpus
    at_target_naive = tr.rate * float(naive_eval["attainment"]) / naive.gpus
    return {
        "name": name,
        "profile": profile,
        "traffic": traffic,
        "chunked_prefill": chunk,
        "slo_s": {"ttft_p90": ttft_s, "tpot_p90": tpot_s},
        "plan_s": round(plan_s, 2),
        "planned": c.label(),
        "planned_gpus": c.gpus,
        "planned_max_rate": round(c.max_rate, 3),
        "planned_goodput_per_gpu": round(g_plan, 4),
        "naive": naive.label(),
        "naive_gpus": naive.gpus,
        "naive_peak_throughput_per_instance": round(peak, 3),
        "naive_max_rate": round(naive_rate, 3),
        "naive_goodput_per_gpu": round(g_naive, 4),
        "naive_attainment_at_target": round(float(naive_eval["attainment"]), 4),
        "ratio": round(g_plan / g_naive, 3) if g_naive > 0 else None,
        "slo_goodput_per_gpu_at_target": {
            "planned": round(at_target_plan, 4),
            "naive": round(at_target_naive, 4),
        },
        "ratio_at_target": round(at_target_plan / at_target_naive, 3) if at_target_naive > 0 else None,
        "runners_up": [f"{r.label()}: {why}" for r, why in res.runners_up],
    }


CASES = [
    # DistServe's own illustration (OSDI'24 Fig. 1): OPT-13B on A100, input 512, output 64, SLO p90
    # TTFT 0.4 s / TPOT 0.04 s, on the profile calibrated to that figure's prefill-only and decode-only
    # goodputs (benchmarks/scripts/calibrate_distserve.py). Published: 2P+1D 3.3 req/s/GPU vs vLLM 1.6.
    ("distserve-fig1", "opt-13b-a100-distserve", "rate=10;in=fixed:512;out=fixed:64;cv=1", 0.4, 0.04),
    (
        "chatbot-opt13b-calibrated",
        "opt-13b-a100-distserve",
        "rate=20;in=lognormal:256,0.8;out=lognormal:256,0.8;cv=1",
        0.25,
        0.1,
    ),
    # The same two with chunked prefill (2048-token budget) on every aggregated engine, the plan's
    # candidates and the naive baseline alike: what the comparison looks like against vLLM V1.
    (
        "distserve-fig1-chunked",
        "opt-13b-a100-distserve",
        "rate=10;in=fixed:512;out=fixed:64;cv=1",
        0.4,
        0.04,
        2048,
    ),
    (
        "chatbot-opt13b-calibrated-chunked",
        "opt-13b-a100-distserve",
        "rate=20;in=lognormal:256,0.8;out=lognormal:256,0.8;cv=1",
        0.25,
        0.1,
        2048,
    ),
    (
        "summarization-opt13b-calibrated",
        "opt-13b-a100-distserve",
        "rate=10;in=lognormal:1500,0.4;out=lognormal:128,0.5;cv=1",
        1.5,
        0.05,
    ),
    (
        "chatbot-opt13b-calibrated-tight-tpot",
        "opt-13b-a100-distserve",
        "rate=20;in=lognormal:256,0.8;out=lognormal:256,0.8;cv=1",
        0.25,
        0.05,
    ),
    # DistServe-like chatbot: OPT-13B on A100 (published-derived profile), ShareGPT-like lengths;
    # SLOs of the order of DistServe's chatbot setting (TTFT 0.25 s, TPOT 0.1 s) and a tighter TPOT.
    ("chatbot-opt13b", "opt-13b-a100", "rate=20;in=lognormal:256,0.8;out=lognormal:256,0.8;cv=1", 0.25, 0.1),
    (
        "chatbot-opt13b-tight-tpot",
        "opt-13b-a100",
        "rate=20;in=lognormal:256,0.8;out=lognormal:256,0.8;cv=1",
        0.25,
        0.03,
    ),
    (
        "summarization-opt13b",
        "opt-13b-a100",
        "rate=10;in=lognormal:1500,0.4;out=lognormal:128,0.5;cv=1",
        1.5,
        0.05,
    ),
    ("chat-llama8b-h100-bursty", "llama3-8b-h100", "rate=40;chat;cv=2", 0.3, 0.02),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--url", help="a running llama.cpp server (default: start one)")
    ap.add_argument("--model", default="smollm2")
    args = ap.parse_args()
    out: dict[str, Any] = {"benchmark": "p7_planner", "created_unix": time.time()}
    out["simulation"] = [simulation_case(*c) for c in CASES]
    for c in out["simulation"]:
        print(
            f"{c['name']}: planned {c['planned']} {c['planned_goodput_per_gpu']:.3g}/GPU vs naive "
            f"{c['naive']} {c['naive_goodput_per_gpu']:.3g}/GPU = {c['ratio']}x; at the target rate "
            f"{c['ratio_at_target']}x (plan {c['plan_s']} s)"
        )
    previous = RESULTS / "p7_planner.json"
    if args.skip_llama and previous.exists():
        # Keep the last measured prediction error: it needs a quiet host, the simulation does not.
        prev = json.loads(previous.read_text())
        if "prediction" in prev:
            out["prediction"] = {
                **prev["prediction"],
                "measured_unix": prev.get("prediction_unix", prev["created_unix"]),
            }
    if not args.skip_llama:
        with tempfile.TemporaryDirectory() as d:
            if args.url:
                out["prediction"] = validate(args.url, args.model, Path(d))
            else:
                from support.llama import LlamaServer

                with LlamaServer(log_dir=d) as srv:
                    out["prediction"] = validate(srv.url, srv.model_alias, Path(d))
        out["prediction_unix"] = time.time()
        p = out["prediction"]
        print(
            f"llama.cpp p90: measured {p['measured']}, plan {p['predicted_plan']} "
            f"(err {p['rel_error_plan']}), replay {p['predicted_replay']} (err {p['rel_error_replay']})"
        )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "p7_planner.json").write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {RESULTS / 'p7_planner.json'}")


if __name__ == "__main__":
    main()

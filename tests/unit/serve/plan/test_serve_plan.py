"""Planner, traffic parsing, plan file and the ``serve plan`` CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpufleet.core.errors import UsageError
from gpufleet.serve.common.slo import SLO
from gpufleet.serve.plan import launch as lm
from gpufleet.serve.plan import planner as pl
from gpufleet.serve.plan.profile import load_profile
from gpufleet.serve.plan.traffic import load_traffic, parse_traffic
from support.cli import CliResult, gpufleet

PLAN_SLO = SLO.of(ttft=0.25, tpot=0.1, percentile=90, attainment=0.9)


def _cli(*args: str) -> CliResult:
    return gpufleet("serve", *args)


def test_traffic_spec_and_errors(tmp_path: Path) -> None:
    t = parse_traffic("rate=4;chat;cv=2")
    assert t.rate == 4 and t.cv == 2 and str(t.inp) == "lognormal:512,0.6"
    u = t.unit(4000)
    gaps = u.arrival[1:] - u.arrival[:-1]
    assert gaps.mean() == pytest.approx(1.0, rel=0.1) and gaps.std() / gaps.mean() == pytest.approx(
        2.0, rel=0.15
    )
    for bad, msg in (
        ("rate=-1", "must be > 0"),
        ("in=fixed:5", "needs rate"),
        ("rate=1;foo=2", "unknown key"),
        ("rate=1;cv=x", "not a number"),
    ):
        with pytest.raises(UsageError, match=msg):
            parse_traffic(bad)
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "\n".join(
            json.dumps({"timestamp": i * 500, "input_length": 100 + i, "output_length": 20, "hash_ids": []})
            for i in range(10)
        )
    )
    tt = load_traffic(str(trace))
    assert tt.rate == pytest.approx(2.0) and tt.unit(25).inp[10] == 100
    (tmp_path / "bad.jsonl").write_text('{"timestamp": 0}\n')
    with pytest.raises(UsageError, match="line 1"):
        load_traffic(str(tmp_path / "bad.jsonl"))


def test_plan_chooses_fewest_gpus_and_writes_schema() -> None:
    prof = load_profile("opt-13b-a100")
    tr = parse_traffic("rate=6;in=lognormal:256,0.8;out=lognormal:256,0.8")
    res = pl.plan(prof, tr, pl.PlanOptions(PLAN_SLO, n_sim=600, size_top=6))
    assert res.feasible and res.chosen.gpus >= 1
    assert all(r.gpus >= res.chosen.gpus for r, _ in res.runners_up)
    assert res.chosen.max_rate >= 6.0 and res.chosen.eval["attainment"] >= 0.9
    doc = lm.plan_document(
        res,
        prof,
        tr,
        pl.PlanOptions(PLAN_SLO, price_per_gpu_hour=2.0),
        "w",
        {"kind": "node", "gpus": 8, "name": "node8"},
    )
    assert doc["schema"] == "gpufleet.serve.plan" and doc["version"] == 1
    assert sum(g["gpus"] for g in doc["groups"]) == doc["gpus"] == doc["config"]["gpus"]
    assert doc["cost_per_hour"] == pytest.approx(2.0 * doc["gpus"])
    assert doc["slo"] == {"ttft_p90_ms": 250.0, "tpot_p90_ms": 100.0, "attainment": 0.9}


def test_pd_groups_fit_the_domain() -> None:
    c = pl.Candidate("disaggregated", p_tp=2, p_replicas=4, p_batch=8, d_tp=1, d_replicas=6, d_batch=64)
    g = lm.groups(c, 8)
    by: dict[str, int] = {}
    for x in g:
        by[x["pd_group"]] = by.get(x["pd_group"], 0) + x["gpus"]
    assert sum(by.values()) == 14 and max(by.values()) <= 8 and len(by) == 2
    roles = {x["pd_group"]: {y["role"] for y in g if y["pd_group"] == x["pd_group"]} for x in g}
    assert all(r == {"prefill", "decode"} for r in roles.values())
    assert lm.pd_units(pl.Candidate("disaggregated", p_tp=8, p_replicas=1, d_tp=8, d_replicas=1), 8) is None
    assert lm.launch(c, load_profile("opt-13b-a100"), 8)["deployment"]["prefill"]["replicas"] == 4


def test_planned_shape_beats_naive_default_per_gpu() -> None:
    """Tight TPOT: the planned shape's goodput per GPU is at least the naive default's
    (aggregated TP1, max batch 256, sized by peak throughput), the P7 comparison."""
    prof = load_profile("opt-13b-a100")
    tr = parse_traffic("rate=20;in=lognormal:512,0.6;out=lognormal:256,0.6")
    opts = pl.PlanOptions(SLO.of(ttft=0.25, tpot=0.03, percentile=90, attainment=0.9), n_sim=600)
    res = pl.plan(prof, tr, opts)
    assert res.feasible
    naive = pl.Candidate("aggregated", tp=1, replicas=8, max_batch=256, unit_rate=1.0)
    naive_rate = pl.system_max_rate(naive, prof, tr, opts)
    assert res.chosen.max_rate / res.chosen.gpus >= naive_rate / naive.gpus


def test_chunked_prefill_plan_launches_what_it_modelled(tmp_path: Path) -> None:
    prof = load_profile("opt-13b-a100-distserve")
    tr = parse_traffic("rate=10;in=fixed:512;out=fixed:64;cv=1")
    slo = SLO.of(ttft=0.4, tpot=0.04, percentile=90, attainment=0.9)
    opts = pl.PlanOptions(slo, modes=("aggregated",), n_sim=600, chunked_prefill=512)
    res = pl.plan(prof, tr, opts)
    c = res.chosen
    assert c.feasible and c.chunk == 512 and "chunk 512" in c.label()
    assert all(x.chunk == 512 for x in res.candidates)
    doc = lm.plan_document(res, prof, tr, opts, "fig1", {"name": "hgx8", "gpus": 8})
    args = doc["launch"]["vllm_args"]
    assert "--enable-chunked-prefill" in args and "--no-enable-chunked-prefill" not in args
    assert args[args.index("--max-num-batched-tokens") + 1] == "512"
    # the plan file round-trips the budget, so --replan simulates the same engine
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    again, _ = lm.candidate_from_plan(path)
    assert again.chunk == 512 and again.max_batch == c.max_batch


def test_replan_rebalances_pd() -> None:
    prof = load_profile("opt-13b-a100")
    slo = SLO.of(ttft=0.5, tpot=0.06, percentile=90, attainment=0.9)
    cur = pl.Candidate("disaggregated", p_tp=1, p_replicas=1, p_batch=256, d_tp=1, d_replicas=3, d_batch=256)
    # prompts get much longer: the prefill side is now short
    win = parse_traffic("rate=3;in=lognormal:1500,0.3;out=lognormal:64,0.3")
    res = pl.replan(cur, prof, win, pl.PlanOptions(slo, n_sim=500))
    assert not res["passes_now"] and res["action"] in ("rebalance", "scale-up")
    assert res["proposed"] != res["current"]


def test_cli_plan_files_and_exit_codes(tmp_path: Path) -> None:
    out = tmp_path / "plan"
    r = _cli(
        "plan",
        "--profile",
        "opt-13b-a100",
        "--traffic",
        "rate=3;in=fixed:256;out=fixed:128",
        "--slo",
        "ttft_p90=300ms,tpot_p90=100ms",
        "--sim-requests",
        "400",
        "--out",
        str(out),
        "--price-per-gpu-hour",
        "2.5",
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads((out / "plan.json").read_text())
    assert doc["feasible"] and (out / "pareto.png").stat().st_size > 1000
    assert "vllm serve" in r.stdout or "prefill (" in r.stdout
    # replan against the file just written: same traffic, keep
    rr = _cli(
        "plan",
        "--profile",
        "opt-13b-a100",
        "--replan",
        "--current",
        str(out / "plan.json"),
        "--window",
        "rate=3;in=fixed:256;out=fixed:128",
        "--slo",
        "ttft_p90=300ms,tpot_p90=100ms",
        "--json",
        "--sim-requests",
        "400",
    )
    assert rr.returncode == 0, rr.stderr
    assert json.loads(rr.stdout)["action"] == "keep"
    # infeasible: says so, shows the closest candidate, exit 1
    r = _cli(
        "plan",
        "--profile",
        "opt-13b-a100",
        "--traffic",
        "rate=3;in=fixed:2000;out=fixed:64",
        "--slo",
        "ttft_p90=20ms,tpot_p90=5ms",
        "--sim-requests",
        "300",
    )
    assert (
        r.returncode == 1
        and "INFEASIBLE" in r.stderr
        and "closest:" in r.stdout
        and "Traceback" not in r.stderr
    )
    for args, msg in (
        (["--traffic", "rate=-2"], "must be > 0"),
        (["--traffic", "rate=2", "--rack", "nvl9000"], "unknown rack"),
        (["--traffic", str(tmp_path / "missing.jsonl")], "trace file not found"),
        (["--traffic", "rate=2", "--slo", "ttft_p90=fast"], "--slo"),
        (["--traffic", "rate=2", "--chunked-prefill", "10"], "--chunked-prefill"),
    ):
        r = _cli("plan", "--profile", "opt-13b-a100", *args)
        assert r.returncode == 2 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    r = _cli("plan", "--profile", str(bad), "--traffic", "rate=1")
    assert r.returncode == 2 and "not valid JSON" in r.stderr


def test_cli_profile_from_table(tmp_path: Path) -> None:
    t = tmp_path / "t.csv"
    t.write_text(
        "phase,tp,batch,input_len,context,time_ms\nprefill,1,1,128,,25\nprefill,1,1,512,,70\n"
        "prefill,1,1,1024,,140\ndecode,1,1,,512,16\ndecode,1,32,,512,26\ndecode,1,64,,1024,45\n"
    )
    r = _cli(
        "profile",
        "--from-table",
        str(t),
        "--model",
        "m",
        "--hardware",
        "H100",
        "--out",
        str(tmp_path / "p.json"),
    )
    assert r.returncode == 0, r.stderr
    assert load_profile(str(tmp_path / "p.json")).source == "table"
    r = _cli("profile", "--from-table", str(t), "--url", "http://x")
    assert r.returncode == 2 and "exactly one" in r.stderr

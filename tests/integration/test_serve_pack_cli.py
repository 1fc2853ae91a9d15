"""``gpufleet serve pack`` end to end: two small plan files → table, JSON, PNG; exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ortools", reason="the pack extra (ortools) is not installed")

GPUFLEET = [sys.executable, "-m", "gpufleet.cli.main"]

CHAT = {
    "schema": "gpufleet.serve.plan",
    "version": 1,
    "workload": "chat",
    "feasible": True,
    "config": {"mode": "aggregated", "tp": 2, "replicas": 4, "max_batch": 64, "gpus": 10},
    "gpus": 10,
    "groups": [{"id": "r0", "role": "replica", "tp": 4, "gpus": 4, "pd_group": None}]
    + [{"id": f"r{i}", "role": "replica", "tp": 2, "gpus": 2, "pd_group": None} for i in (1, 2, 3)],
}
RAG = {
    "schema": "gpufleet.serve.plan",
    "version": 1,
    "workload": "rag",
    "feasible": True,
    "config": {"mode": "disaggregated", "gpus": 6},
    "gpus": 6,
    "pd_groups": 2,
    "groups": [
        {"id": "p0", "role": "prefill", "tp": 1, "gpus": 1, "pd_group": "pd0"},
        {"id": "d0", "role": "decode", "tp": 2, "gpus": 2, "pd_group": "pd0"},
        {"id": "p1", "role": "prefill", "tp": 1, "gpus": 1, "pd_group": "pd1"},
        {"id": "d1", "role": "decode", "tp": 2, "gpus": 2, "pd_group": "pd1"},
    ],
}


def pack(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*GPUFLEET, "serve", "pack", *args], capture_output=True, text=True, timeout=60)


@pytest.fixture()
def plans(tmp_path: Path) -> list[str]:
    (tmp_path / "chat.json").write_text(json.dumps(CHAT))
    (tmp_path / "rag.json").write_text(json.dumps(RAG))
    return [str(tmp_path / "chat.json"), str(tmp_path / "rag.json")]


def test_table_json_and_png(plans, tmp_path):
    out = tmp_path / "out"
    p = pack("--plans", *plans, "--nodes", "8x4", "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert "placement by NVLink domain" in p.stdout and "node-0" in p.stdout and "rag" in p.stdout
    # 4,2,2,2 + two 1+2 P/D groups on 8-GPU nodes: optimum 2 nodes, FFD needs 3
    assert "OPTIMAL: cost 2 (2/4 domains, 16 GPUs placed" in p.stderr
    assert "FFD alone: cost 3, gap 50.0%" in p.stderr
    doc = json.loads((out / "placement.json").read_text())
    assert doc["schema"] == "gpufleet.serve.placement" and doc["version"] == 1
    assert (doc["status"], doc["objective"]["cost"], doc["bound"], doc["gap"]) == ("OPTIMAL", 2, 2, 0)
    pd = {}
    for pl in doc["placements"]:
        if pl["pd_group"]:
            pd.setdefault(pl["pd_group"], set()).add(pl["domain"])
    assert len(pd) == 2 and all(len(v) == 1 for v in pd.values())
    assert (out / "racks.png").read_bytes()[:4] == b"\x89PNG"


def test_json_stdout_racks_anti_affinity(plans, tmp_path):
    p = pack(
        "--plans",
        plans[0],
        plans[1],
        "--racks",
        "nvl36:4",
        "--anti-affinity",
        "--json",
        "--no-plot",
        "--out",
        str(tmp_path / "o"),
    )
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["params"]["anti_affinity"] is True and not (tmp_path / "o" / "racks.png").exists()
    chat = [pl["domain"] for pl in doc["placements"] if pl["workload"] == "chat"]
    assert len(set(chat)) == 4  # four chat replicas, four racks
    assert doc["status"] == "OPTIMAL" and doc["objective"]["domains_used"] == 4


def test_ffd_fallback_states_the_gap(plans, tmp_path):
    p = pack(
        "--plans",
        *plans,
        "--nodes",
        "8x4",
        "--time-limit",
        "0.000001",
        "--workers",
        "1",
        "--json",
        "--no-plot",
        "--out",
        str(tmp_path / "o"),
    )
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert (doc["status"], doc["method"], doc["objective"]["cost"], doc["bound"]) == ("FEASIBLE", "ffd", 3, 2)
    assert doc["gap"] == pytest.approx(0.5) and "gap 50.0%" in p.stderr and "time limit" in p.stderr


def test_exit_codes(plans, tmp_path):
    p = pack("--plans", *plans, "--nodes", "8x1", "--out", str(tmp_path / "a"))
    assert p.returncode == 1
    assert p.stderr.strip() == (
        "gpufleet: error: not enough capacity: the plans need 16 GPUs, the fleet "
        "has 8 (1× hgx8 (8 GPUs)); short by 8 GPUs"
    )
    p = pack("--plans", *plans, "--racks", "gb300:2")
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1
    assert "unknown rack type 'gb300'; valid: nvl72 (72 GPUs), nvl36 (36 GPUs), hgx8 (8 GPUs)" in p.stderr
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**CHAT, "groups": [{"id": "r0", "gpus": -1}]}))
    p = pack("--plans", str(bad), "--nodes", "8x2")
    assert p.returncode == 2 and "groups[0].gpus must be an integer >= 1" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    p = pack("--nodes", "8x2")
    assert p.returncode == 2 and "at least one plan" in p.stderr
    p = pack("--plans", *plans)
    assert p.returncode == 2 and "--racks" in p.stderr

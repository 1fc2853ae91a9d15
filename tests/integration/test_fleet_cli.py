"""`gpufleet fleet simulate` as a user runs it, on a real run directory made by `gpufleet run`.

The run (2 gloo ranks, a kill -9 of rank 1, checkpoints every 5 steps) gives a ledger with a real
incident and real checkpoints; --from-run must take exactly `gpufleet report`'s figures from it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

GPUFLEET = [sys.executable, "-m", "gpufleet.cli.main"]
SCRIPT = str(Path(__file__).parent / "scripts" / "toy_train.py")


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*GPUFLEET, *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("fleet_run")
    p = cli(
        "run", "-n", "2", "--run-dir", str(d), "--checkpoint-every", "5", "--hang-timeout", "3",
        "--no-progress",
        "--inject", "kill:rank=1,step=8,settle=1", "--", sys.executable, SCRIPT, "--steps", "14",
        timeout=150,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    return d


def test_from_run_projects_the_runs_recovery_stack_to_100k_gpus(run_dir, tmp_path):
    rep = json.loads(cli("report", str(run_dir), "--json", "--no-plot").stdout)
    assert rep["mttr"]["count"] >= 1 and rep["checkpoints"]["committed"] >= 2
    plots = tmp_path / "plots"
    p = cli("fleet", "simulate", "--from-run", str(run_dir), "--gpus", "100000", "--days", "3",
            "-r", "50", "--json", "--plot-dir", str(plots))  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    s = json.loads(p.stdout)
    assert s["schema"] == "gpufleet.fleet/1" and s["gpus"] == 100000 and s["nodes"] == 12500
    cal = s["calibration"]
    ph = rep["mttr"]["phases_mean_s"]
    assert cal["world_size"] == 2 and cal["incidents"] == rep["mttr"]["count"]
    assert cal["detect_s"] == pytest.approx(ph["detect"])
    assert cal["restart_s"] == pytest.approx(ph["teardown"] + ph["spawn_init"] + ph["first_step"])
    assert cal["load_s"] == pytest.approx(ph["load"])
    assert cal["stall_s"] == pytest.approx(rep["checkpoints"]["stall_s"]["p50"])
    assert cal["persist_s"] == pytest.approx(rep["checkpoints"]["persist_s"]["p50"])
    assert cal["step_s"] == pytest.approx(rep["steps"]["mean_step_s"])
    st = {x["name"]: x for x in s["strategies"]}
    assert len(st) == 8
    assert st["gpufleet-async"]["stall_s"] == pytest.approx(cal["stall_s"])
    assert st["gpufleet-async"]["persist_s"] == pytest.approx(cal["persist_s"])
    assert s["recovery_s"]["detect_s"] == pytest.approx(cal["detect_s"])
    for x in st.values():
        e = x["ettr"]
        assert 0 < e["ci_low"] <= e["mean"] <= e["ci_high"] < 1
        assert sum(b["mean"] for b in x["badput_share"].values()) + e["mean"] == pytest.approx(1.0)
    # Spares turn 30-minute requeues into swaps: at 12,500 nodes that is most of the badput.
    assert st["peer-inproc+spares"]["ettr"]["mean"] > st["sync"]["ettr"]["mean"] + 0.2
    assert s["sweep"]["gpus"][0] == 1024 and s["sweep"]["gpus"][-1] == 100000
    assert all(len(v) == len(s["sweep"]["gpus"]) for v in s["sweep"]["ettr"].values())
    for key in ("goodput_png", "badput_png"):
        assert Path(s[key]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_llama3_table_matches_the_paper():
    p = cli("fleet", "simulate", "--profile", "llama3-h100", "--gpus", "16384", "--days", "54",
            "-r", "100", "--no-sweep", "--no-plot")  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    out = p.stdout
    for needle in ("Faulty GPU", "GPU HBM3 Memory", "unexpected", "planned", "MTBF", "sync+spares", "ETTR"):
        assert needle in out
    row = next(line for line in out.splitlines() if "unexpected" in line)
    assert abs(float(row.split("│")[2]) - 419) <= 41.9

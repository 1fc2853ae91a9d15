"""Straggler detection on a real supervised run: 2 gloo ranks under DDP, one made slow before its
forward (the ``slow`` drill: it sleeps at the start of each step, as a rank with a slow data pipeline or
a throttled device would). The supervisor flags exactly that rank, once, in the ledger and the report;
the run itself is untouched (no restart)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpufleet.core.ledger import read_events

pytestmark = pytest.mark.slow

GPUFLEET = [sys.executable, "-m", "gpufleet.cli.main"]
TOY = str(Path(__file__).parent / "scripts" / "toy_train.py")


def test_a_slow_rank_under_ddp_is_flagged_in_the_ledger_and_the_report(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cmd = [
        *GPUFLEET,
        "run",
        "-n",
        "2",
        "--run-dir",
        str(run_dir),
        "--no-progress",
        "--inject",
        "slow:rank=1,delay=0.04",
        "--",
        sys.executable,
        TOY,
        "--steps",
        "100",
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    found = [e for e in read_events(run_dir) if e["ev"] == "straggler"]
    # Under DDP both ranks reach the end of the step together: only the forward timing tells them apart.
    assert [(e["rank"], e["section"], e["attempt"]) for e in found] == [(1, "fwd", 0)]
    assert found[0]["seconds"] >= 0.04 and found[0]["ratio"] > 1.5
    assert "rank 1 is a straggler: fwd" in p.stderr
    assert not [e for e in read_events(run_dir) if e["ev"] == "restart"]

    rep = subprocess.run(
        [*GPUFLEET, "report", str(run_dir), "--json"], capture_output=True, text=True, timeout=120
    )
    assert rep.returncode == 0, rep.stderr
    got = json.loads(rep.stdout)["stragglers"]
    assert [(g["rank"], g["section"]) for g in got] == [(1, "fwd")]
    text = subprocess.run([*GPUFLEET, "report", str(run_dir)], capture_output=True, text=True, timeout=120)
    assert "straggler" in text.stdout and "rank 1" in text.stdout


def test_straggler_action_restart_replaces_the_slow_rank_in_process(tmp_path: Path, toy_reference) -> None:
    """--straggler-action restart: the flagged rank is a failure, recovered through the fast path (the
    healthy rank keeps its process); the drill fired once, so the replacement runs at full speed and the
    run ends bit-identical to an unslowed one."""
    from support.toyrun import final_sha, gpufleet_run

    run_dir = tmp_path / "run"
    p = gpufleet_run(run_dir, "--straggler-action", "restart", "--in-process-restart",
                     "--inject", "slow:rank=1,delay=0.04", steps=100, timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    events = read_events(run_dir)
    failures = [e for e in events if e["ev"] == "failure"]
    assert [(e["cause"], e["rank"]) for e in failures] == [("straggler", 1)]
    assert "straggler: fwd" in failures[0]["detail"]
    (restart,) = [e for e in events if e["ev"] == "restart"]
    assert restart["reason"] == "straggler" and restart["path"] == "in_process"
    pids = [e["pids"] for e in events if e["ev"] == "attempt_start"]
    assert pids[1][0] == pids[0][0] and pids[1][1] != pids[0][1]  # rank 0 kept, rank 1 replaced
    assert final_sha(run_dir) == toy_reference(steps=100)["sha256"]

"""The demo end to end, shortened: reference run, faulted run (crash, hang, NaN, corrupt checkpoint),
and bit-identical final weights."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpufleet.core import events as E
from gpufleet.core.ledger import read_events
from gpufleet.demo.runner import DemoConfig, fault_plan, run_demo

# the demo's reference run and its faulted run, can pass 300 s on a loaded host
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_fault_plan_spreads_four_kinds_between_checkpoints() -> None:
    plan = fault_plan(400, 25)
    assert [s.split(":")[0] for s in plan] == ["ckpt_corrupt", "kill", "hang", "nan"]
    steps = [int(s.split("step=", 1)[1].split(",")[0]) for s in plan]
    assert steps == sorted(steps) and steps[-1] < 400
    assert "rank=1" in plan[1]


def test_demo_recovers_from_every_fault_with_identical_weights(tmp_path: Path) -> None:
    cfg = DemoConfig(dir=tmp_path, steps=120, checkpoint_every=15, progress=False, plot=False)
    result = run_demo(cfg, console=None)

    assert result.reference is not None and result.reference.status == "completed"
    assert result.faulted.status == "completed", result.faulted
    assert result.exit_code == 0
    assert result.identical is True
    assert result.comparison is not None
    assert result.comparison["a"]["sha256"] == result.comparison["b"]["sha256"]
    assert result.comparison["a"]["step"] == result.comparison["b"]["step"] == 120

    events = read_events(tmp_path / "faulted")
    causes = [e.get("cause") for e in events if e["ev"] == E.Failure.kind]
    assert len(causes) >= 3, causes
    assert {"crash", "hang"} <= set(causes)
    assert {"spike", "nan"} & set(causes)
    restarts = [e for e in events if e["ev"] == E.Restart.kind]
    assert len(restarts) >= 3
    # The crash and the hang take the in-process path; the NaN rolls every rank back (full restart).
    paths = {e["reason"]: e["path"] for e in restarts}
    assert paths == {"crash": "in_process", "hang": "in_process", "spike": "full"}, restarts
    # ... in place: the survivor kept its model (whose causal-mask buffer DDP broadcasts in every
    # forward, where the failure meets it first) and the lost rank's hot spare joined it.
    rejoins = [e for e in events if e["ev"] == E.Rejoin.kind]
    assert len(rejoins) == 2 and all(e["in_place"] for e in rejoins), rejoins
    ready = [e for e in events if e["ev"] == E.WorkerReady.kind and e["attempt"] in (1, 2)]
    assert sum(e["hot_spare"] for e in ready) == 2, ready
    assert any(e["ev"] == E.RestoreRejected.kind for e in events)  # the corrupted checkpoint
    assert [e["status"] for e in events if e["ev"] == E.RunEnd.kind] == ["completed"]

    ref_events = read_events(tmp_path / "reference")
    assert not [e for e in ref_events if e["ev"] == E.Failure.kind]
    assert (tmp_path / "demo_result.json").is_file()


def test_train_lm_early_stop_books_the_last_step(tmp_path: Path) -> None:
    """Standalone, one process: patience 1 with a learning rate too small to improve stops at the
    second evaluation, and the final checkpoint is labelled with the number of steps that ran."""
    import json
    import os
    import subprocess
    import sys

    from gpufleet.demo.compare import latest_checkpoint

    env = {**os.environ, "GPUFLEET_RUN_DIR": str(tmp_path), "GPUFLEET_CKPT_EVERY": "10"}
    cmd = [sys.executable, "-W", "ignore", "-m", "gpufleet.demo.train_lm", "--steps", "100"]
    cmd += ["--eval-every", "10", "--patience", "1", "--lr", "1e-7", "--warmup", "0", "--sample-chars", "0"]
    subprocess.run(cmd, env=env, check=True, timeout=120, capture_output=True)
    summary = json.loads((tmp_path / "train_lm_summary.json").read_text())
    assert summary["stopped_early"] is True
    assert latest_checkpoint(tmp_path)[0] == 20
    steps = [e["step"] for e in read_events(tmp_path) if e["ev"] == E.Step.kind]
    assert steps == list(range(20))

"""A script that never imports gpufleet, under `gpufleet run`: its optimizer steps reach the ledger.

tests/integration/scripts/plain_ddp_train.py is a plain torchrun-style job (env://, DDP on gloo, a
DistributedSampler, Adam, its own torch.save snapshot every 10 steps, resumed from when present).
With init and hang timeouts of 5 s and a run longer than that, a rank that sends no heartbeat would
be killed as hung; here rank 1 is killed -9 from outside once the ledger shows step 24, and the run
must recover from the script's own snapshot with the report counting steps, goodput and an MTTR.
Rank 1 also sleeps 0.03 s before each forward, as a slow data pipeline would: once the restarted
attempt runs at full speed, the supervisor's straggler detection flags it from the hook's timings
(the first attempt's 0.25 s per step hides it, and it is killed before three windows of steps).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpufleet.core.ledger import read_events

pytestmark = pytest.mark.slow

SCRIPT = str(Path(__file__).parent / "scripts" / "plain_ddp_train.py")
GPUFLEET = [sys.executable, "-m", "gpufleet.cli.main"]
KILL_AT = 24  # a step of the fresh run, past the snapshot at 20 (steps sleep 0.25 s until the kill)


def _wait_for_step(run_dir: Path, proc: subprocess.Popen[str]) -> list[int]:
    """The first attempt's pids, once rank 0's step KILL_AT of that attempt is in the ledger."""
    deadline = time.monotonic() + 240  # a guard against a wedged run, not a timing assertion
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the run ended before step {KILL_AT}: {proc.stderr.read()[-3000:]}"  # type: ignore[union-attr]
        events = read_events(run_dir)
        if any(e["ev"] == "step" and e.get("attempt") == 0 and e["step"] >= KILL_AT for e in events):
            start = next(e for e in events if e["ev"] == "attempt_start" and e["attempt"] == 0)
            return list(start["pids"])
        time.sleep(0.05)
    raise AssertionError(f"no step {KILL_AT} in the ledger")


def test_unmodified_script_is_watched_and_recovers_with_steps_goodput_and_mttr(tmp_path):
    run_dir, work = tmp_path / "run", tmp_path / "work"
    work.mkdir()
    cmd = [*GPUFLEET, "run", "-n", "2", "--run-dir", str(run_dir), "--init-timeout", "5",
           "--hang-timeout", "5", "--no-progress", "--",
           sys.executable, SCRIPT, "--dir", str(work), "--steps", "100", "--fresh-sleep", "0.25",
           "--slow-rank", "1", "--slow-delay", "0.03"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pids = _wait_for_step(run_dir, proc)
        os.kill(pids[1], signal.SIGKILL)
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    events = read_events(run_dir)

    def of(kind: str) -> list[dict]:
        return [e for e in events if e["ev"] == kind]

    # Only the kill: more than 5 s of training without a gpufleet call, and no hang verdict.
    assert [(f["cause"], f["rank"], f.get("signal")) for f in of("failure")] == [("crash", 1, 9)]
    assert of("run_end")[-1]["status"] == "completed" and of("run_end")[-1]["restarts"] == 1
    steps = {a: [e["step"] for e in of("step") if e["attempt"] == a] for a in (0, 1)}
    assert steps[0][: KILL_AT + 1] == list(range(KILL_AT + 1))
    # The second attempt numbers its steps from the snapshot it resumed at (Adam's step count).
    resumed = json.loads((work / "done.json").read_text())["resumed_at"]
    assert resumed >= 20 and steps[1] == list(range(resumed, 100))
    # The script's torch.save snapshots (rank 0, a path): checkpoint events with their size.
    saves = of("ckpt_committed")
    assert saves and all(e["bytes"] > 0 and e["path"].endswith("snapshot.pt.tmp") for e in saves)
    assert {e["step"] for e in saves if e["attempt"] == 0} >= {9, 19}

    # The slow rank, from its DDP forward timings (every rank ends a DDP step together): flagged once,
    # in the attempt that ran three full windows of steps, and the run goes on.
    found = [(e["rank"], e["section"], e["attempt"]) for e in of("straggler")]
    assert found == [(1, "fwd", 1)], found
    assert "rank 1 is a straggler: fwd" in err

    out = subprocess.run([*GPUFLEET, "report", str(run_dir), "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["steps"]["executed"] > 0 and report["steps"]["last_step"] == 99
    assert report["goodput"] > 0
    assert report["failures"] == {"count": 1, "by_cause": {"crash": 1}, "unrecovered": 0}
    (incident,) = report["incidents"]
    assert incident["recovered"] and incident["mttr_s"] > 0
    assert report["mttr"]["count"] == 1 and report["mttr"]["mean_s"] > 0
    assert [(g["rank"], g["section"]) for g in report["stragglers"]] == [(1, "fwd")]

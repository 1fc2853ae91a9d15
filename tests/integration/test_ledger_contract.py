"""The ledger contract end to end: the real supervisor and 2 gloo ranks write the ledger, and
``gpufleet report --json`` counts what was really emitted (failures by cause, rollbacks, skipped
windows, goodput). Every assertion compares the report with the ledger's own events, never a time.

The drill (tests/integration/scripts/toy_train.py, 18 steps, a checkpoint every 3):
  attempt 0: rank 1 is killed at step 6 (after its save settled)             -> crash
  attempt 1: resumes, the loss is NaN at step 12 (persist=1: a data-caused spike) -> spike, replay
  attempt 2: replays the same batches, NaN again at step 12                   -> spike, skip
  attempt 3: restores and skips the batch window up to step 12, finishes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpufleet.core import events as E
from gpufleet.core.ledger import read_events, read_typed

pytestmark = pytest.mark.slow

SCRIPT = str(Path(__file__).parent / "scripts" / "toy_train.py")
GPUFLEET = [sys.executable, "-m", "gpufleet.cli.main"]
STEPS, STEPS_PER_EPOCH = 18, 16  # toy_train: 512 samples, 16 per rank and step, 2 ranks


def test_report_counts_what_the_ledger_holds(tmp_path: Path) -> None:
    run = [
        "run",
        "-n",
        "2",
        "--run-dir",
        str(tmp_path),
        "--checkpoint-every",
        "3",
        "--no-progress",
    ]
    drills = ["--inject", "kill:rank=1,step=6,settle=1", "--inject", "nan:step=12,persist=1"]
    train = ["--", sys.executable, SCRIPT, "--steps", str(STEPS)]
    p = subprocess.run([*GPUFLEET, *run, *drills, *train], capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]

    # Every ledger line is a valid event of this version, strictly.
    raw = read_events(tmp_path)
    typed = [E.parse_event(r, strict=True) for r in raw]
    assert typed == read_typed(tmp_path) and all(r["v"] == E.LEDGER_VERSION for r in raw)

    def of(cls: type[E.Event]) -> list:
        return [e for e in typed if isinstance(e, cls)]

    failures, rollbacks, skips = of(E.Failure), of(E.Rollback), of(E.Skip)
    assert [f.cause for f in failures] == [E.FailureCause.CRASH, E.FailureCause.SPIKE, E.FailureCause.SPIKE]
    assert [r.mode for r in rollbacks] == [E.RollbackMode.REPLAY, E.RollbackMode.SKIP]
    assert [s.step for s in of(E.Spike)] == [12, 12]
    decided = rollbacks[1]
    assert (decided.from_step, decided.skip_to) == (12, 13)
    # The skip rank 0 really took is the window the supervisor decided.
    assert [(s.skipped_from, s.skipped_to) for s in skips] == [(decided.skip_from, decided.skip_to)]
    # epoch_end after the last step of an epoch: step 15 runs only in the last attempt.
    assert [(e.epoch, e.step) for e in of(E.EpochEnd)] == [(0, STEPS_PER_EPOCH - 1)]

    rep = subprocess.run(
        [*GPUFLEET, "report", str(tmp_path), "--json"], capture_output=True, text=True, timeout=120
    )
    assert rep.returncode == 0, rep.stderr[-2000:]
    s = json.loads(rep.stdout)
    assert s["failures"] == {"count": 3, "by_cause": {"crash": 1, "spike": 2}, "unrecovered": 0}
    assert s["rollbacks"] == len(rollbacks) == 2
    assert s["skipped_windows"] == len(skips) == 1
    skipped = skips[0].skipped_to - skips[0].skipped_from
    assert s["skipped_steps"] == skipped > 0
    assert s["restarts"] == 3 and s["restores"] == len(of(E.Restore)) == 4
    # Three counted failures, all recovered. The second spike joins the first one's incident when
    # the replay restored the checkpoint taken at step 12 (if that save was not skipped behind a slow
    # persist): no step completed between the two.
    assert sum(i["failures"] for i in s["incidents"]) == 3 and all(i["recovered"] for i in s["incidents"])
    assert s["mttr"]["count"] == len(s["incidents"]) in (2, 3)
    # Every step index ran and was kept exactly once, except the skipped batches.
    assert s["steps"]["productive"] == STEPS - skipped and s["steps"]["last_step"] == STEPS - 1
    assert s["steps"]["executed"] == len(of(E.Step)) == s["steps"]["productive"] + s["steps"]["rolled_back"]
    assert s["sessions"][0]["status"] == "completed" and s["sessions"][0]["restarts"] == 3
    # Goodput: present, in (0, 1], productive / wall, and the wall time splits into its categories.
    assert 0.0 < s["goodput"] <= 1.0
    assert s["goodput"] == pytest.approx(s["productive_s"] / s["wall_s"])
    assert s["badput"]["productive"]["s"] == pytest.approx(s["productive_s"])
    assert s["badput"]["recompute"]["s"] > 0.0  # the skip rollback to step 0 threw steps 0-11 away
    assert all(v["s"] >= 0.0 for v in s["badput"].values())
    # idle (supervisor start, shutdown, the step a failure cut short) is the remainder, so productive
    # and the badput categories add up to the wall time.
    assert s["badput"]["idle"]["s"] > 0.0
    assert sum(v["s"] for v in s["badput"].values()) == pytest.approx(s["wall_s"])

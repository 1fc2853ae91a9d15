"""When the supervisor warms standby interpreters, and at which priority.

The first attempt's standbys warm at normal priority once it has committed its first checkpoint (a
short job that ends before it never pays their imports); standbys made for an attempt that is about to start
are promoted at once and import at normal priority; a restarted attempt's replacements warm at idle
priority, and only once it is healthy (its restore and first step are MTTR).
"""

from __future__ import annotations

import sys
from pathlib import Path

from gpufleet.core.ledger import read_events
from gpufleet.train.supervisor import Supervisor, SupervisorConfig

# Attempt 0 commits a checkpoint, waits until the supervisor has recorded it, and fails; attempt 1
# (promoted standbys) finishes.
SCRIPT = """
import os, sys, time
import torch
import gpufleet
run = gpufleet.init(checkpoint_every="2")
run.restore({"w": torch.zeros(2)})
ledger = os.path.join(os.environ["GPUFLEET_RUN_DIR"], "ledger.jsonl")
for step in run.steps(6):
    run.log(loss=1.0)
    if step == 3 and os.environ["GPUFLEET_ATTEMPT"] == "0":
        while '"ckpt_committed"' not in open(ledger).read():
            time.sleep(0.01)
        sys.exit(3)
"""


def test_first_standbys_wait_for_a_commit_and_replacements_idle_once_healthy(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    run_dir = tmp_path / "run"
    cfg = SupervisorConfig(
        command=[sys.executable, str(script)], run_dir=str(run_dir), nproc=1, max_restarts=2
    )
    sup = Supervisor(cfg)
    calls: list[tuple[str, bool, bool]] = []  # (call, eager or first attempt, a commit in the ledger)
    prepare, start = sup.backend.prepare, sup.backend.start

    def committed() -> bool:
        return any(e["ev"] == "ckpt_committed" for e in read_events(run_dir))

    def recording_prepare(spec, *, eager=False):  # type: ignore[no-untyped-def]
        calls.append(("prepare", eager, committed()))
        prepare(spec, eager=eager)

    def recording_start(spec):  # type: ignore[no-untyped-def]
        calls.append(("start", spec.attempt == 0, committed()))
        return start(spec)

    sup.backend.prepare = recording_prepare  # type: ignore[method-assign]
    sup.backend.start = recording_start  # type: ignore[method-assign]
    outcome = sup.run()
    assert outcome.exit_code == 0, outcome
    # attempt 0: fresh workers, no standby until its checkpoint committed, then one at normal priority;
    # attempt 1: its standbys (already there: a no-op) asked for at normal priority just before it
    # starts, its replacements at idle priority once it has stepped.
    assert calls == [
        ("start", True, False),
        ("prepare", True, True),
        ("prepare", True, True),
        ("start", False, True),
        ("prepare", False, True),
    ]
    evs = [e["ev"] for e in read_events(run_dir)]
    assert evs.count("attempt_start") == 2


def test_a_run_that_ends_before_its_first_commit_starts_no_standby(tmp_path: Path) -> None:
    # Only run.finish()'s final checkpoint commits: the run is ending, so no standby is worth its imports.
    script = tmp_path / "train.py"
    script.write_text(
        "import torch, gpufleet\n"
        "run = gpufleet.init(checkpoint_every='1000')\n"
        "run.restore({'w': torch.zeros(2)})\n"
        "for step in run.steps(3):\n"
        "    run.log(loss=1.0)\n"
        "run.finish()\n"
    )
    run_dir = tmp_path / "run"
    sup = Supervisor(SupervisorConfig(command=[sys.executable, str(script)], run_dir=str(run_dir), nproc=1))
    calls: list[bool] = []
    prepare = sup.backend.prepare

    def recording_prepare(spec, *, eager=False):  # type: ignore[no-untyped-def]
        calls.append(eager)
        prepare(spec, eager=eager)

    sup.backend.prepare = recording_prepare  # type: ignore[method-assign]
    assert sup.run().exit_code == 0
    assert [e["step"] for e in read_events(run_dir) if e["ev"] == "ckpt_committed"] == [3]  # the final one
    assert calls == []

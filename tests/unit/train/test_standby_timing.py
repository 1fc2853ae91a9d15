"""When the supervisor warms standby interpreters, and at which priority.

The first attempt's spares warm *eagerly* (normal priority) right after its workers start, so their
imports overlap the workers' start-up; a restarted attempt's replacements warm at idle priority, and
only once it is healthy (its restore and first step are MTTR). P9 measured the cost of getting this
wrong: idle-priority imports that trickled into the first training steps.
"""

from __future__ import annotations

import sys
from pathlib import Path

from gpufleet.core.ledger import read_events
from gpufleet.train.supervisor import Supervisor, SupervisorConfig

# Attempt 0 fails after its first step; attempt 1 (promoted standbys) finishes.
SCRIPT = """
import os, sys
import torch
import gpufleet
run = gpufleet.init()
run.restore({"w": torch.zeros(2)})
for step in run.steps(3):
    run.log(loss=1.0)
    if step == 1 and os.environ["GPUFLEET_ATTEMPT"] == "0":
        sys.exit(3)
"""


def test_first_spares_warm_eagerly_after_start_and_replacements_idle_once_healthy(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    cfg = SupervisorConfig(
        command=[sys.executable, str(script)], run_dir=str(tmp_path / "run"), nproc=1, max_restarts=2
    )
    sup = Supervisor(cfg)
    calls: list[tuple[str, bool]] = []
    prepare, start = sup.backend.prepare, sup.backend.start

    def recording_prepare(spec, *, eager=False):  # type: ignore[no-untyped-def]
        calls.append(("prepare", eager))
        prepare(spec, eager=eager)

    def recording_start(spec):  # type: ignore[no-untyped-def]
        calls.append(("start", spec.attempt == 0))
        return start(spec)

    sup.backend.prepare = recording_prepare  # type: ignore[method-assign]
    sup.backend.start = recording_start  # type: ignore[method-assign]
    outcome = sup.run()
    assert outcome.exit_code == 0, outcome
    # attempt 0: fresh workers, then its spares, eagerly; every later warm-up (the healthy attempt 0's
    # no-op, attempt 1's replacements once it has stepped) at idle priority.
    assert calls[:2] == [("start", True), ("prepare", True)]
    assert ("start", False) in calls[2:]
    assert [eager for kind, eager in calls[2:] if kind == "prepare"] == [False] * (len(calls) - 3)
    evs = [e["ev"] for e in read_events(tmp_path / "run")]
    assert evs.count("attempt_start") == 2

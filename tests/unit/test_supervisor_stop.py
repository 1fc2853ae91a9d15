"""A stop signal (SIGTERM, or Slurm's time-limit USR1) that lands between attempts ends the run.

Starting another attempt would only signal its ranks again while they start up, before they can
take a final checkpoint; under Slurm the batch script then requeues the job from the newest one.
"""

from __future__ import annotations

import os
import signal
import sys

from gpufleet.backends import CONTINUE
from gpufleet.core.ledger import read_events
from gpufleet.train.supervisor import Supervisor, SupervisorConfig


def test_stop_signal_during_failure_handling_starts_no_new_attempt(tmp_path):
    cfg = SupervisorConfig(
        command=[sys.executable, "-c", "import sys; sys.exit(3)"],
        run_dir=str(tmp_path),
        standby=False,
        max_restarts=5,
    )
    sup = Supervisor(cfg)

    def after_failure(run, ledger, blame=None):  # USR1 arrives while the failure is handled
        os.kill(os.getpid(), signal.SIGUSR1)
        return CONTINUE

    sup.backend.after_failure = after_failure  # type: ignore[attr-defined]
    outcome = sup.run()
    assert outcome.status == "interrupted" and outcome.exit_code == 0
    evs = [e["ev"] for e in read_events(tmp_path)]
    assert evs.count("attempt_start") == 1 and "restart" not in evs

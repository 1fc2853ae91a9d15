"""A stop request (SIGUSR1) can arrive twice: under Slurm the step's signal reaches every process of
the step and the node agent forwards it as well. The first is taken; a duplicate must never kill
the rank while it checkpoints and exits (Python's finalization restores SIG_DFL for handlers it
installed, so a second SIGUSR1 during interpreter shutdown used to end the rank with -10)."""

from __future__ import annotations

import os
import signal

import pytest
import torch

import gpufleet


@pytest.fixture(autouse=True)
def _restore_usr1():
    before = signal.getsignal(signal.SIGUSR1)
    yield
    signal.signal(signal.SIGUSR1, before)


def test_the_first_request_is_taken_and_a_duplicate_ignored(tmp_path) -> None:
    run = gpufleet.init(run_dir=str(tmp_path / "run"), checkpoint_every="1000")
    model = torch.nn.Linear(2, 2)
    run.restore({"model": model})
    assert signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, signal.SIG_IGN)
    os.kill(os.getpid(), signal.SIGUSR1)
    os.kill(os.getpid(), signal.SIGUSR1)  # the duplicate: ignored, the process lives on
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN
    with pytest.raises(SystemExit) as stop:  # the next step boundary: final checkpoint, exit 0
        for _ in run.steps(10):
            pass
    assert stop.value.code == 0
    assert len(list((tmp_path / "run" / "checkpoints").glob("step_*"))) == 1  # the final one


def test_a_request_after_the_run_finished_is_ignored(tmp_path) -> None:
    run = gpufleet.init(run_dir=str(tmp_path / "run"), checkpoint_every="1000")
    run.restore({"model": torch.nn.Linear(2, 2)})
    for _ in run.steps(2):
        pass
    run.finish()
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN
    os.kill(os.getpid(), signal.SIGUSR1)  # a late request (a time-limit signal) during the exit

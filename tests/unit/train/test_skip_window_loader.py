"""A skipped batch window skips a resumable loader's batches too, like it does for a StepSampler.

After a recurring spike the supervisor tells the next attempt to skip steps [a, b). With
``gpufleet.resumable(loader)`` the batch is not a function of the step, so the run API must advance the
loader by the skipped steps' batches; otherwise step b would train on step a's (the spike's) batch.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

import gpufleet
from gpufleet.core.settings import RollbackPlan


def test_skip_window_advances_a_resumable_loader(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUFLEET_ROLLBACK", RollbackPlan(skip=((2, 5),)).to_env())
    run = gpufleet.init(run_dir=str(tmp_path / "run"), checkpoint_every="1000")
    batches = gpufleet.resumable(DataLoader(TensorDataset(torch.arange(20)), batch_size=1))
    run.restore({"data": batches})
    trained = {}
    for step in run.steps(8):
        (x,) = next(batches)
        trained[step] = int(x)
    run.finish()
    # steps 2, 3, 4 are skipped together with their batches 2, 3, 4
    assert trained == {0: 0, 1: 1, 5: 5, 6: 6, 7: 7}

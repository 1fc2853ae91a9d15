"""A run that resumes through the restore's template, as a script (its own process, like a user's):
bit-identical to the same script without gpufleet, and a run whose checkpoints are all corrupt starts
fresh, with no fake optimizer step. tests/unit/train/test_restore_template.py tests the template.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


SCRIPT = """
import json, os, sys, torch, gpufleet
steps = int(sys.argv[1])
run = gpufleet.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
calls = []
opt.register_step_pre_hook(lambda *a: calls.append(1))
start = run.restore({"model": model, "optim": opt})
report = {"start": start, "steps_in_restore": len(calls), "state_after_restore": len(opt.state)}
g = torch.Generator().manual_seed(1)
for step in run.steps(steps):
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
    loss = model(x).square().mean()
    loss.backward()
    opt.step(); opt.zero_grad()
    run.log(loss=loss.item())
run.finish()
report["weights"] = [p.detach().flatten().tolist() for p in model.parameters()]
open(os.path.join(os.environ["GPUFLEET_RUN_DIR"], f"report-{start}.json"), "w").write(json.dumps(report))
"""


PLAIN = """
import json, sys, torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
for step in range(int(sys.argv[1])):
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
    model(x).square().mean().backward()
    opt.step(); opt.zero_grad()
print(json.dumps([p.detach().flatten().tolist() for p in model.parameters()]))
"""


def _plain(tmp_path: Path, steps: int) -> object:
    script = tmp_path / "plain_train.py"
    script.write_text(PLAIN)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(
        [sys.executable, str(script), str(steps)], capture_output=True, text=True, env=env, timeout=120
    )
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def _run(run_dir: Path, steps: int) -> dict[str, object]:
    script = run_dir.parent / "prime_train.py"
    script.write_text(SCRIPT)
    env = {
        **os.environ,
        "GPUFLEET_RUN_DIR": str(run_dir),
        "GPUFLEET_CKPT_EVERY": "10",
        "OMP_NUM_THREADS": "1",
    }
    p = subprocess.run(
        [sys.executable, str(script), str(steps)], capture_output=True, text=True, env=env, timeout=120
    )
    assert p.returncode == 0, p.stderr
    reports = sorted(run_dir.glob("report-*.json"), key=lambda f: f.stat().st_mtime)
    return json.loads(reports[-1].read_text())


def test_a_run_resumes_exactly_and_a_run_with_only_corrupt_checkpoints_starts_fresh(tmp_path: Path) -> None:
    straight = _run(tmp_path / "straight", 30)
    # a fresh start makes no load template: no fake optimizer step (torch's, for the template)
    assert (
        straight["start"] == 0 and straight["state_after_restore"] == 0 and straight["steps_in_restore"] == 0
    )
    assert straight["weights"] == _plain(tmp_path, 30)  # the same script without gpufleet

    _run(tmp_path / "resumed", 20)
    resumed = _run(tmp_path / "resumed", 30)
    assert resumed["start"] == 20 and resumed["steps_in_restore"] == 0
    assert resumed["weights"] == straight["weights"]

    # Every checkpoint damaged: the restore finds nothing and the optimizer starts empty, so the run
    # is the same as one that never had a checkpoint (a fake step would have left Adam's step at 1).
    _run(tmp_path / "corrupt", 20)
    for shard in (tmp_path / "corrupt" / "checkpoints").glob("step_*/*.distcp"):
        shard.write_bytes(b"\0" * shard.stat().st_size)
    again = _run(tmp_path / "corrupt", 30)
    assert again["start"] == 0 and again["state_after_restore"] == 0
    assert again["weights"] == straight["weights"]

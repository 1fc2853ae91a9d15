"""The restore's template: optimizer state shaped from the checkpoint's metadata, not by a fake step.

torch's state-dict helpers make an optimizer's state exist before a load by running ``step()`` with
zero gradients (``_init_optim_state``): for AdamW a whole update pass that a restart waits for. The
run API primes the state from the newest checkpoint's DCP metadata instead; these tests hold it to
the contract: nothing is stepped, the loaded state equals the saved one, and a restore that finds
nothing leaves the optimizer as fresh as it was.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpufleet.checkpoint import CheckpointConfig, CheckpointEngine
from gpufleet.train.statedict import StateMapper

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _model_and_optim(seed: int, *, amsgrad: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model[2].bias.requires_grad_(False)  # a frozen parameter: no state in the checkpoint
    params = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, amsgrad=amsgrad)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        model(torch.randn(5, 8, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("amsgrad", [False, True])
def test_primed_state_loads_equal_to_the_saved_one_without_an_optimizer_step(
    tmp_path: Path, amsgrad: bool
) -> None:
    model, opt = _model_and_optim(0, amsgrad=amsgrad)
    _train(model, opt, 3)
    saver = StateMapper({"model": model, "optim": opt}, rank=0)
    eng = CheckpointEngine(CheckpointConfig(dir=str(tmp_path)))
    eng.save(3, saver.collect())
    eng.wait()

    model2, opt2 = _model_and_optim(1, amsgrad=amsgrad)
    stepped: list[int] = []
    opt2.register_step_pre_hook(lambda *a: stepped.append(1))
    mapper = StateMapper({"model": model2, "optim": opt2}, rank=0)
    fresh = CheckpointEngine(CheckpointConfig(dir=str(tmp_path)))
    primed = mapper.prime_optimizers(fresh.newest_metadata())
    assert primed == [opt2]
    result = fresh.load(mapper.collect())
    assert result is not None and result.step == 3
    mapper.apply(result.state_dict, step=3)
    assert stepped == []  # the template cost no optimizer step
    assert opt2.state_dict()["state"].keys() == opt.state_dict()["state"].keys()
    for pid, saved in opt.state_dict()["state"].items():
        got = opt2.state_dict()["state"][pid]
        assert got.keys() == saved.keys()
        for k in saved:
            assert torch.equal(got[k], saved[k]), (pid, k)
    # and training goes on exactly as the original does
    _train(model, opt, 2)
    _train(model2, opt2, 2)
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)


def test_nothing_is_primed_without_a_checkpoint_or_for_a_stateful_optimizer(tmp_path: Path) -> None:
    model, opt = _model_and_optim(0)
    mapper = StateMapper({"model": model, "optim": opt}, rank=0)
    eng = CheckpointEngine(CheckpointConfig(dir=str(tmp_path)))
    assert eng.newest_metadata() is None
    assert mapper.prime_optimizers(None) == []
    _train(model, opt, 1)
    eng.save(1, mapper.collect())
    eng.wait()
    before = {id(v) for s in opt.state.values() for v in s.values()}
    assert mapper.prime_optimizers(eng.newest_metadata()) == []  # it has state: left as it is
    assert {id(v) for s in opt.state.values() for v in s.values()} == before
    # a .metadata that does not match its manifest is not read
    (tmp_path / "step_00000001" / ".metadata").write_bytes(b"not a pickle")
    assert eng.newest_metadata() is None


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

"""The restore's template: optimizer state shaped from the checkpoint's metadata, not by a fake step.

torch's state-dict helpers make an optimizer's state exist before a load by running ``step()`` with
zero gradients (``_init_optim_state``): for AdamW a whole update pass that a restart waits for. The
run API primes the state from the newest checkpoint's DCP metadata instead; these tests hold it to
the contract: nothing is stepped, the loaded state equals the saved one, and a restore that finds
nothing leaves the optimizer as fresh as it was.
"""

from __future__ import annotations

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

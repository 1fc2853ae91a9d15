"""gpufleet.train.exactddp on real gloo process groups of 3 ranks (torch.multiprocessing).

A resumed attempt is modelled in one process as what it is to DDP: a new ``DistributedDataParallel``
over the same weights and optimizer, mid-run. Without the hook its first all-reduce sums in one
initial bucket and the run drifts from an unbroken one; with it, the run is bit-identical.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

from gpufleet.train.exactddp import DDPWatcher

WORLD = 3
STEPS, RESUME_AT = 8, 4


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    # > 1 MiB of parameters, so the rebuilt layout has several buckets (DDP's first one is 1 MiB)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 1024), torch.nn.ReLU(),
        torch.nn.Linear(1024, 10),
    )  # fmt: skip


def _train(rank: int, mode: str, **ddp_kwargs) -> tuple[torch.Tensor, list | None]:
    """mode: plain (no hook, unbroken), resume (no hook), watched (the hook, resumed), watched_inner
    (the hook, found through the inner module), changed (the saved layout names other parameters)."""
    net = _model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    ddp, watcher, layout = DDP(net, **ddp_kwargs), None, None
    if mode.startswith("watched") or mode == "changed":
        watcher = DDPWatcher(ddp, saved=None)
    for step in range(STEPS):
        if step == RESUME_AT and mode != "plain":
            saved = watcher.checkpoint_layout() if watcher else None
            layout = saved
            if mode == "changed":
                saved = [["not.a.parameter"]]
            ddp = DDP(net, **ddp_kwargs)
            if watcher is not None:
                watcher = DDPWatcher(net if mode == "watched_inner" else ddp, saved=saved)
        g = torch.Generator().manual_seed(step * 100 + rank)
        x, y = torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if watcher is not None:
            watcher.stop_watching()
    return torch.cat([p.detach().flatten() for p in net.parameters()]), layout


def _user_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks the parameter names
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])


def _worker(rank: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    results = {m: _train(rank, m) for m in ("plain", "resume", "watched", "watched_inner", "changed")}
    unused = _train(rank, "watched", find_unused_parameters=True)
    net = _model()
    user = DDP(net)
    user.register_comm_hook(None, _user_hook)
    attached_to_user_hook = DDPWatcher(user, saved=None).exact is not None
    if rank == 0:
        torch.save({"results": results, "unused": unused, "user_hook": attached_to_user_hook}, out)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def outcome(tmp_path_factory: pytest.TempPathFactory) -> dict:
    d: Path = tmp_path_factory.mktemp("exactddp")
    out = d / "out.pt"
    mp.spawn(_worker, args=(f"file://{d / 'pg'}", str(out)), nprocs=WORLD)
    return torch.load(out)


def test_without_the_hook_a_new_ddp_drifts_from_the_unbroken_run(outcome: dict) -> None:
    # The defect itself, on this model: what makes the other tests meaningful.
    res = outcome["results"]
    assert not torch.equal(res["plain"][0], res["resume"][0])


def test_the_hook_records_the_rebuilt_buckets(outcome: dict) -> None:
    layout = outcome["results"]["watched"][1]
    names = [n for group in layout for n in group]
    assert len(layout) >= 2, layout  # the 1 MiB first bucket, then the rest
    assert sorted(names) == sorted(f"{i}.{w}" for i in (0, 2, 4) for w in ("weight", "bias"))
    assert layout[0][0].startswith("4.")  # the last layer's gradients are ready first


@pytest.mark.parametrize("mode", ["watched", "watched_inner"])
def test_a_resumed_ddp_with_the_hook_is_bit_identical_to_the_unbroken_run(outcome: dict, mode: str) -> None:
    res = outcome["results"]
    assert torch.equal(res["plain"][0], res[mode][0])


def test_a_layout_that_does_not_fit_the_model_is_not_replayed(outcome: dict) -> None:
    # Same collectives on every rank, no hang; just not the unbroken run's sums.
    res = outcome["results"]
    assert torch.equal(res["changed"][0], res["resume"][0])


def test_ddp_setups_it_does_not_cover_are_left_alone(outcome: dict) -> None:
    assert outcome["unused"][1] is None  # find_unused_parameters: DDP never rebuilds, nothing to record
    assert outcome["user_hook"] is False  # the user's own communication hook stays theirs


def test_a_new_watcher_ends_the_global_hook_of_an_abandoned_one() -> None:
    # An in-process restart can abandon a round before its first step: its finder must not linger.
    from torch.nn.modules import module as module_mod

    before = len(module_mod._global_forward_pre_hooks)
    first = DDPWatcher(torch.nn.Linear(2, 2), saved=None)
    assert len(module_mod._global_forward_pre_hooks) == before + 1
    second = DDPWatcher(torch.nn.Linear(2, 2), saved=None)
    assert len(module_mod._global_forward_pre_hooks) == before + 1 and first._handle is None
    second.stop_watching()
    assert len(module_mod._global_forward_pre_hooks) == before

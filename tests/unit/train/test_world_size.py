"""Resuming at another world size: StepSampler's position in global samples, per-rank state (RNG,
data loaders) and the engine's optional per-rank entries; DTensor shards through the stager."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import gpufleet
from gpufleet.checkpoint import CheckpointConfig, CheckpointEngine
from gpufleet.checkpoint.staging import StagedShard, Stager
from gpufleet.checkpoint.verify import verify_dir
from gpufleet.core.errors import ConfigError
from gpufleet.train.state import RNGState, StepSampler
from gpufleet.train.statedict import StateMapper


def _global(samplers: list[StepSampler], steps: range) -> list[int]:
    return [i for s in steps for smp in samplers for i in smp.indices(s)]


def _perm(n: int, seed: int) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("new_world", [1, 3, 4])
def test_step_sampler_continues_the_permutation_at_the_next_sample(new_world: int) -> None:
    n, batch, seed, k = 100, 4, 7, 17  # 2 workers: 12 steps per epoch; step 17 is epoch 1, sample 40
    old = [StepSampler(n, batch, seed=seed, rank=r, world_size=2) for r in range(2)]
    assert old[0].position(k) == (1, 40)
    new = [StepSampler(n, batch, seed=0, rank=r, world_size=new_world) for r in range(new_world)]
    for s in new:
        s.load_state_dict(old[0].state_dict())
    gb = batch * new_world
    left = (n - 40) // gb  # global batches still in epoch 1 at the new size
    got = _global(new, range(k, k + left + 2))
    perm1, perm2 = _perm(n, seed + 1), _perm(n, seed + 2)
    assert got == perm1[40 : 40 + left * gb] + perm2[: 2 * gb]
    assert new[0].epoch_of(k + left) == 2
    # the state saved after the change describes the new geometry; a restart at it lands on the same steps
    again = [StepSampler(n, batch, rank=r, world_size=new_world) for r in range(new_world)]
    for s in again:
        s.load_state_dict(new[0].state_dict())
    assert _global(again, range(k + 3, k + 6)) == _global(new, range(k + 3, k + 6))
    with pytest.raises(ValueError, match="before the step"):
        new[0].indices(k - 1)


def test_step_sampler_state_before_placement_and_legacy_state() -> None:
    a = StepSampler(100, 4, seed=7, rank=0, world_size=2)
    b = StepSampler(100, 4, rank=0, world_size=3)
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()  # not placed yet: the loaded position is kept as it was
    legacy = {"seed": 7, "num_samples": 100, "batch_size": 4}  # saved before positions were recorded
    c = StepSampler(100, 4, rank=0, world_size=2)
    c.load_state_dict(legacy)
    assert c.indices(30) == a.indices(30)
    with pytest.raises(ValueError, match="dataset changed"):
        StepSampler(90, 4).load_state_dict(a.state_dict())


def test_rng_without_saved_state_is_derived_from_step_and_rank() -> None:
    rng = RNGState()
    draws = []
    for rank in (2, 2, 3):
        rng.resume_without_state(40, rank)
        draws.append((random.random(), torch.rand(2).tolist()))
    assert draws[0] == draws[1] and draws[0] != draws[2]


def test_per_rank_loader_refuses_a_world_size_change_and_rng_follows() -> None:
    loader = DataLoader(TensorDataset(torch.arange(10)), batch_size=2)
    mapper = StateMapper({"data": gpufleet.resumable(loader), "rng": RNGState(), "x": 1}, rank=0)
    mapper.check_world_size(2, 2)
    mapper.check_world_size(None, 3)
    with pytest.raises(ConfigError, match=r"saved by 2 workers and this run has 3: state\['data'\]"):
        mapper.check_world_size(2, 3)
    assert mapper.rank_entries() == [("data", "rank0"), ("data", "shared"), ("rng", "rank0")]
    StateMapper({"rng": RNGState(), "x": 1}, rank=2).check_world_size(2, 3)  # RNG alone can follow


def test_engine_drops_optional_entries_the_checkpoint_lacks(tmp_path: Path) -> None:
    eng = CheckpointEngine(CheckpointConfig(dir=str(tmp_path)))
    assert eng.save(5, {"w": torch.ones(3), "rng": {"rank0": {"s": torch.zeros(2)}}})
    eng.wait()
    got = {"w": torch.zeros(3), "rng": {"rank1": {"s": torch.ones(2)}}}
    r = eng.load(got, optional=[("rng", "rank1")])
    assert r is not None and r.missing == ["rng.rank1"] and "rng" not in got
    assert torch.equal(got["w"], torch.ones(3))
    with pytest.raises(CheckpointException) as err:  # not optional: DCP's missing-key error stands
        eng.load({"w": torch.zeros(3), "rng": {"rank1": {"s": torch.ones(2)}}})
    assert "Missing key in checkpoint state_dict: rng.rank1.s" in repr(err.value)
    eng.close()


@pytest.fixture
def one_rank_group(tmp_path: Path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_dtensor_is_staged_as_its_local_shard_and_checksums_verify(tmp_path: Path, one_rank_group) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    full = torch.arange(12.0).reshape(4, 3)
    dt = distribute_tensor(full, mesh, [Shard(0)])
    staged = Stager().stage({"m": {"w": dt}}, deferred=lambda k: True)
    staged.done.wait()
    shard = staged.staged["m"]["w"]
    assert isinstance(shard, StagedShard) and not isinstance(shard, DTensor)
    assert type(shard.__get_tensor_shard__(None)) is torch.Tensor
    assert [w.index.fqn for w in shard.__create_write_items__("m.w", shard)] == ["m.w"]
    dt.to_local().add_(100)  # the staged copy is a snapshot
    assert torch.equal(shard.as_subclass(torch.Tensor), full)

    eng = CheckpointEngine(CheckpointConfig(dir=str(tmp_path / "ck")))
    assert eng.save(1, {"m": {"w": dt}}, deferred=lambda k: True)
    eng.wait()
    manifest, reason = verify_dir(tmp_path / "ck" / "step_00000001", 2)
    assert reason is None and manifest is not None
    plain = {"m": {"w": torch.zeros(4, 3)}}  # a DTensor checkpoint loads into a plain tensor
    assert eng.load(plain) is not None
    assert torch.equal(plain["m"]["w"], full + 100)
    # a large DTensor: the one-pass restore reads it into the staging buffer of its local shard
    big = distribute_tensor(torch.randn(512, 1024), mesh, [Shard(0)])
    assert eng.save(2, {"m": {"w": big}})
    eng.wait()
    into = {"m": {"w": distribute_tensor(torch.zeros(512, 1024), mesh, [Shard(0)])}}
    r = eng.load(into)
    assert r is not None and r.step == 2 and torch.equal(into["m"]["w"].to_local(), big.to_local())
    eng.close()


def _dist_loader(world: int, rank: int, n: int = 50, batch: int = 3) -> gpufleet.ResumableLoader:
    ds = TensorDataset(torch.arange(n))
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=5)
    return gpufleet.resumable(DataLoader(ds, batch_size=batch, sampler=sampler))


def _order(world: int, rank: int, epoch: int, n: int = 50) -> list[int]:
    ds = TensorDataset(torch.arange(n))
    s = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=5)
    s.set_epoch(epoch)
    return list(s)


@pytest.mark.parametrize("new_world", [1, 3])
def test_a_distributed_sampler_loader_resumes_at_another_world_size(new_world: int) -> None:
    n, batch = 50, 3
    old = [_dist_loader(2, r) for r in range(2)]
    for _ in range(len(old[0].loader) + 4):  # into epoch 1: 4 batches of 3 on each of 2 ranks
        for x in old:
            next(x)
    assert old[0].epoch == 1 and old[0].shared_state_dict() == old[1].shared_state_dict()
    consumed = old[0].shared_state_dict()["consumed"]
    assert consumed == 4 * batch * 2
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(5 + 1)).tolist()

    new = [_dist_loader(new_world, r) for r in range(new_world)]
    mapper = StateMapper({"data": new[-1]}, rank=new_world - 1)
    mapper.check_world_size(2, new_world)  # a DistributedSampler's position follows
    shared = {"shared": old[0].shared_state_dict()}
    mapper.apply({"data": shared})  # the last rank may have had no per-rank entry: the shared one decides
    for x in new[:-1]:
        x.load_shared_state_dict(old[0].shared_state_dict())
    rest: list[int] = []
    after: list[list[int]] = []
    while True:
        got = [next(x)[0].tolist() for x in new]
        if new[0].epoch != 1:
            after = got
            break
        rest += [i for b in got for i in b]
    want = perm[consumed:]
    assert sorted(set(rest)) == sorted(want)  # every remaining sample, none taken before
    assert len(rest) - len(want) < new_world  # repeats only to even out the ranks' shares
    assert after == [_order(new_world, r, 2)[:batch] for r in range(new_world)]  # then epochs as usual


def test_a_resharded_epoch_resumes_at_its_own_world_size_too() -> None:
    old = [_dist_loader(2, r) for r in range(2)]
    for _ in range(3):
        for x in old:
            next(x)
    a = _dist_loader(3, 1)
    a.load_shared_state_dict(old[0].shared_state_dict())
    next(a)
    saved = a.state_dict()
    expect = [next(a)[0].tolist() for _ in range(12)]  # through the epoch boundary
    b = _dist_loader(3, 1)
    b.load_state_dict(saved)  # a restart of the 3-worker run, inside the resharded epoch
    assert [next(b)[0].tolist() for _ in range(12)] == expect


def test_a_loader_without_distributed_sampler_cannot_take_a_shared_position() -> None:
    plain = gpufleet.resumable(DataLoader(TensorDataset(torch.arange(10)), batch_size=2, shuffle=True))
    assert not plain.follows_world_size
    with pytest.raises(ConfigError, match="DistributedSampler"):
        plain.load_shared_state_dict(plain.shared_state_dict())

"""A standby knows its slot's GPU before promotion (backends/local.py, train/standby.py): the slot's
local rank and CUDA_VISIBLE_DEVICES, the same as the rank it becomes; it is promoted only to that
slot; and its CUDA warm-up does nothing on a host without CUDA (this one)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from gpufleet.backends import LaunchSpec
from gpufleet.backends.local import LocalBackend, _Standby
from gpufleet.core.errors import ConfigError
from gpufleet.train.standby import cuda_context

GPU, VISIBLE, LOCAL_RANK = "GPUFLEET_STANDBY_GPU", "CUDA_VISIBLE_DEVICES", "LOCAL_RANK"


def spec(nproc: int, **env: str) -> LaunchSpec:
    return LaunchSpec(command=["python", "train.py"], nproc_per_node=nproc, env=dict(env))


def test_a_standby_starts_with_its_slots_local_rank_and_devices_the_same_as_its_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(VISIBLE, raising=False)
    monkeypatch.delenv("GPUFLEET_STANDBY_CUDA", raising=False)
    b = LocalBackend(min_nproc=1, host_store=False)
    s = spec(3)
    b.active_slots(s)
    for local_rank in range(3):
        before = b.standby_env(s, local_rank)
        after, _ = b._rank_env(s, local_rank)  # the promotion order's environment
        assert before == {GPU: str(local_rank)} and after[LOCAL_RANK] == str(local_rank)
        assert VISIBLE not in after  # every slot in use: the inherited GPUs, as torchrun leaves them
    # Slot 1 dropped: local rank 1 is slot 2, and its GPU is named before CUDA starts in the standby.
    b.slots, b.dropped = [0, 2], [1]
    s = spec(2)
    for local_rank in range(2):
        before = b.standby_env(s, local_rank)
        after, _ = b._rank_env(s, local_rank)
        assert before[VISIBLE] == after[VISIBLE] == "0,2"
        assert before[GPU] == after[LOCAL_RANK] == str(local_rank)


def test_standby_cuda_0_turns_the_warm_up_off_and_a_bad_value_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(VISIBLE, raising=False)
    b = LocalBackend(host_store=False)
    assert b.standby_env(spec(2, GPUFLEET_STANDBY_CUDA="0"), 1) == {}  # as --env gives it
    with pytest.raises(ConfigError, match="GPUFLEET_STANDBY_CUDA"):
        LocalBackend(host_store=False)._standby_cuda(spec(2, GPUFLEET_STANDBY_CUDA="maybe"))
    with pytest.raises(
        ConfigError, match="GPUFLEET_STANDBY_CUDA"
    ):  # `gpufleet run`'s check, before it writes
        LocalBackend.options({"env": ["GPUFLEET_STANDBY_CUDA=maybe"], "env_file": None})
    assert LocalBackend.options({"env": ["GPUFLEET_STANDBY_CUDA=0"], "env_file": None}) == {}
    monkeypatch.setenv("GPUFLEET_STANDBY_CUDA", "maybe")  # the launching shell's: refused at once
    with pytest.raises(ConfigError, match="GPUFLEET_STANDBY_CUDA"):
        LocalBackend(host_store=False)


def standby(slot: int, *, gpu: bool = True, rank: int | None = None, world: int | None = None) -> Any:
    proc = SimpleNamespace(poll=lambda: None, pid=1000 + slot)
    return _Standby(proc, -1, -1, rank=rank, world=world, slot=slot, gpu=gpu)  # type: ignore[arg-type]


def test_a_standby_is_promoted_only_to_its_own_slot_unless_it_warmed_no_gpu() -> None:
    b = LocalBackend(host_store=False)
    zero, one = standby(0), standby(1)
    b._standbys = [zero, one]
    assert b._take_standby(1, 2, 1) is one  # not the first in line: slot 0's holds GPU 0's context
    assert b._take_standby(2, 3, 2) is None  # no standby of slot 2: a fresh process, not GPU 0's
    assert b._take_standby(0, 2, 0) is zero
    cold = standby(0, gpu=False)  # GPUFLEET_STANDBY_CUDA=0: any slot may take it
    b._standbys = [cold]
    assert b._take_standby(1, 2, 1) is cold


def test_the_cuda_warm_up_is_a_no_op_without_cuda() -> None:
    assert not torch.cuda.is_available()  # this host; tests/gpu and scripts/gpu_checks.sh cover a GPU
    assert cuda_context(0) is None
    assert not torch.cuda.is_initialized()

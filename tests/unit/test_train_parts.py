"""Unit tests for the worker-side pieces: fault specs, spike guard, sampler, early stopping, settings."""

from __future__ import annotations

import json
import math

import pytest
import torch

from gpufleet.backends.local import python_entry
from gpufleet.core.errors import ConfigError, UsageError
from gpufleet.core.settings import RollbackPlan, RunSettings
from gpufleet.train.faults import FaultInjector, faults_from_env, faults_to_env, parse_fault, parse_faults
from gpufleet.train.rollback import RollbackPlanner, committed_steps
from gpufleet.train.spike import SpikeGuard
from gpufleet.train.state import EarlyStopping, RNGState, StepSampler


# -- fault specs ---------------------------------------------------------------------------------
def test_fault_specs_parse_and_round_trip():
    faults = parse_faults(
        [
            "kill:rank=1,step=40",
            "kill:after=1.5s",
            "hang:step=9",
            "spike:step=3,factor=50,persist=1",
            "slow:rank=1,delay=20ms,from=2,to=4",
            "ckpt_corrupt:step=10",
        ]
    )
    assert faults[0].rank == 1 and faults[0].step == 40
    assert faults[1].after == 1.5
    assert faults[3].factor == 50 and faults[3].persist
    assert faults[4].delay == pytest.approx(0.02) and (faults[4].start, faults[4].stop) == (2, 4)
    assert faults_from_env(faults_to_env(faults)) == faults


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("boom:step=1", "unknown fault kind"),
        ("kill", "needs step"),
        ("hang:step=x", "integer"),
        ("nan:step=1,color=red", "bad key"),
        ("kill:after=soon", "bad duration"),
        ("slow:rank=0", "delay"),
        ("kill:step=-1", ">= 0"),
    ],
)
def test_bad_fault_specs(spec, needle):
    with pytest.raises(UsageError, match=needle):
        parse_fault(spec)


def test_injector_targets_ranks_and_fires_once():
    fired = []
    inj = FaultInjector(
        parse_faults(["nan:step=2", "spike:step=3,rank=1,factor=10", "ckpt_fail:step=4"]),
        rank=1,
        emit=lambda e: fired.append(e.fault),
    )
    assert inj.loss(1, 1.0) == 1.0
    assert math.isnan(inj.loss(2, 1.0))
    assert inj.loss(2, 1.0) == 1.0  # one-shot
    assert inj.loss(3, 2.0) == 20.0
    assert inj.checkpoint_fault(3) is None
    due = inj.checkpoint_fault(5)
    assert due is not None and due.kind == "ckpt_fail"
    assert inj.checkpoint_fault(6) is due  # a save skipped behind a slow persist leaves it armed
    inj.fired(due, 6)
    assert inj.checkpoint_fault(7) is None
    assert fired == ["nan", "spike", "ckpt_fail"]
    other = FaultInjector(parse_faults(["spike:step=3,rank=1"]), rank=0, emit=lambda e: None)
    assert other.loss(3, 2.0) == 2.0


def test_slow_drill_is_recorded_once_and_keeps_slowing_its_attempt(monkeypatch):
    """A slow rank's drill fires (an inject event, which the supervisor drops before the next attempt)
    at the first step it slows, and goes on slowing every step of that attempt."""
    slept: list[float] = []
    monkeypatch.setattr("gpufleet.train.faults.time.sleep", slept.append)
    fired: list = []
    inj = FaultInjector(parse_faults(["slow:rank=1,delay=5ms,from=2"]), rank=1, emit=fired.append)
    for step in range(5):
        inj.before_step(step)
    assert slept == [0.005] * 3
    assert [(e.fault, e.step, e.persist) for e in fired] == [("slow", 2, False)]
    other = FaultInjector(parse_faults(["slow:rank=1,delay=5ms"]), rank=0, emit=fired.append)
    other.before_step(0)
    assert len(fired) == 1 and slept == [0.005] * 3


def test_settle_waits_for_the_checkpoint_before_the_fault_fires():
    assert parse_fault("kill:rank=1,step=4,settle=1").settle
    assert not parse_fault("hang:step=4").settle
    with pytest.raises(UsageError, match="bad key"):
        parse_fault("nan:step=4,settle=1")  # only kill and hang race a persist

    class Settled(Exception):
        pass

    order: list[str] = []

    def settle() -> None:
        order.append("settle")
        raise Settled  # stands in for the wait; stops the test before the SIGKILL

    inj = FaultInjector(
        parse_faults(["kill:step=4,settle=1"]), rank=0, emit=lambda e: order.append(e.kind), settle=settle
    )
    inj.before_step(3)
    assert order == []
    with pytest.raises(Settled):
        inj.before_step(4)
    assert order == ["settle"]  # the wait comes first; the inject event and the kill follow it


# -- spike guard -----------------------------------------------------------------------------------
def test_spike_guard_flags_nan_and_spikes_not_noise():
    g = SpikeGuard(window=20, threshold=8, min_history=5)
    gen = torch.Generator().manual_seed(0)
    for i in range(30):
        assert g.check(2.0 - 0.01 * i + 0.02 * torch.rand(1, generator=gen).item()) is None
    assert "non-finite" in g.check(float("nan"))
    assert "non-finite" in g.check(float("inf"))
    assert "spike" in g.check(50.0)
    assert g.check(1.72) is None  # back to normal
    g2 = SpikeGuard(window=20, threshold=8, min_history=5)
    g2.load_state_dict(g.state_dict())
    assert "spike" in g2.check(50.0)


def test_spike_guard_waits_for_history():
    g = SpikeGuard(window=10, min_history=5)
    assert g.check(1.0) is None and g.check(100.0) is None  # too little history to judge


# -- sampler / early stopping / RNG ----------------------------------------------------------------
def test_step_sampler_is_a_pure_function_of_step_and_covers_each_epoch_once():
    a = StepSampler(100, 5, seed=1, rank=0, world_size=2)
    b = StepSampler(100, 5, seed=1, rank=1, world_size=2)
    assert a.steps_per_epoch == 10
    epoch0 = [i for s in range(10) for i in a.indices(s) + b.indices(s)]
    assert sorted(epoch0) == list(range(100))
    fresh = StepSampler(100, 5, seed=1, rank=0, world_size=2)
    assert fresh.indices(17) == a.indices(17)  # resume at step 17 sees exactly the same batch
    assert a.indices(3) != a.indices(13)  # a new permutation each epoch
    with pytest.raises(ValueError):
        StepSampler(10, 6, world_size=2)


def test_early_stopping_resumes_its_patience():
    es = EarlyStopping(patience=2, mode="min")
    assert not es.update(1.0) and not es.update(1.1)
    restored = EarlyStopping(patience=2)
    restored.load_state_dict(es.state_dict())
    assert restored.update(1.2)  # the second bad evaluation counts across the restart
    with pytest.raises(ValueError):
        EarlyStopping(patience=0)


def test_rng_state_round_trip():
    rng = RNGState()
    sd = rng.state_dict()
    x = torch.rand(3)
    rng.load_state_dict(sd)
    assert torch.equal(torch.rand(3), x)


# -- settings, entry points, rollback ----------------------------------------------------------------
def test_settings_env_overrides_init_kwargs(monkeypatch, tmp_path):
    monkeypatch.setenv("GPUFLEET_CKPT_EVERY", "7")
    monkeypatch.setenv("GPUFLEET_ROLLBACK", json.dumps({"max_step": 3, "skip": [[1, 4]]}))
    s = RunSettings.load(run_dir=str(tmp_path), checkpoint_every="100", keep_last=2)
    assert s.checkpoint_every == "7" and s.keep_last == 2 and s.rollback.skip == ((1, 4),)
    assert s.ckpt_dir == tmp_path / "checkpoints"
    with pytest.raises(ConfigError, match="unknown gpufleet.init"):
        RunSettings.load(checkpoint_evry="5")
    monkeypatch.setenv("GPUFLEET_KEEP_LAST", "many")
    with pytest.raises(ConfigError, match="GPUFLEET_KEEP_LAST"):
        RunSettings.load()


def test_python_entry_recognises_what_a_standby_can_run():
    assert python_entry(["python", "train.py", "--x", "1"]) == (["train.py", "--x", "1"], False)
    assert python_entry(["/usr/bin/python3", "-m", "pkg.train", "a"]) == (["pkg.train", "a"], True)
    assert python_entry(["python", "-u", "train.py"]) is None
    assert python_entry(["bash", "run.sh"]) is None


def test_rollback_planner_replays_then_skips(tmp_path):
    from gpufleet.core.ledger import Ledger, read_events

    ck = tmp_path / "checkpoints"
    for s in (10, 20, 30, 40):
        (ck / f"step_{s:08d}").mkdir(parents=True)
        (ck / f"step_{s:08d}" / "manifest.json").write_text("{}")
    (ck / "step_00000050").mkdir()  # no manifest: not a checkpoint
    assert committed_steps(ck) == [10, 20, 30, 40]
    planner = RollbackPlanner(tmp_path, window=15)
    with Ledger(tmp_path) as led:
        planner.plan(42, led, attempt=0)
        assert planner.pending() == RollbackPlan(max_step=42, skip=())
        planner.plan(42, led, attempt=1)
    assert planner.pending() == RollbackPlan(max_step=20, skip=((20, 43),))
    assert RollbackPlan.from_env(planner.pending().to_env()) == planner.pending()
    assert committed_steps(ck) == [10, 20]
    assert len(list((ck / "abandoned").iterdir())) == 2  # moved aside, never deleted
    rb = [e for e in read_events(tmp_path) if e["ev"] == "rollback"]
    assert [r["mode"] for r in rb] == ["replay", "skip"] and rb[1]["abandoned"] == [30, 40]


def test_control_all_reduce_gets_a_gloo_group_only_when_the_default_group_cannot_carry_cpu() -> None:
    from gpufleet.train.run import carries_cpu

    assert carries_cpu("gloo") and carries_cpu("cpu:gloo,cuda:nccl") and carries_cpu("mpi")
    assert not carries_cpu("nccl")  # a script's own dist.init_process_group("nccl") before init()
    assert not carries_cpu("cuda:nccl")
    assert carries_cpu("CPU:gloo")

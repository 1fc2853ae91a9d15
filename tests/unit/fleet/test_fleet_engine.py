"""Engine contracts: time is conserved, seeds reproduce, and each mechanism moves what it should."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from gpufleet.fleet.engine import Scenario, simulate
from gpufleet.fleet.profiles import load_profile
from gpufleet.fleet.strategies import METHODS, Strategy, default_spares, strategies, strategy

H = 20 * 86400.0


def one(rate: float, st: Strategy, **kw) -> Scenario:
    return Scenario(
        gpus=8,
        horizon_s=kw.pop("horizon_s", H),
        cause_names=("f",),
        cause_rates=(rate,),
        cause_replace=(kw.pop("replace", False),),
        cause_peer=(kw.pop("peer", True),),
        strategy=st,
        **kw,
    )


def test_every_second_is_booked_once_for_every_strategy():
    prof = load_profile("llama3-h100")
    for st in strategies(prof, 16384):
        r = simulate(Scenario.build(prof, 16384, 10.0, st), 50, seed=1)
        total = r.productive + sum(r.badput.values())
        np.testing.assert_allclose(total, 10 * 86400.0, rtol=1e-9)
        assert (r.productive > 0).all() and all((v >= 0).all() for v in r.badput.values())


def test_same_seed_same_numbers_and_failures_shared_across_strategies():
    prof = load_profile("llama3-h100")
    a, b = (simulate(Scenario.build(prof, 4096, 5.0, strategy(prof, "sync", 4096)), 30, seed=7) for _ in "ab")
    np.testing.assert_array_equal(a.productive, b.productive)
    c = simulate(Scenario.build(prof, 4096, 5.0, strategy(prof, "gpufleet-async", 4096)), 30, seed=7)
    np.testing.assert_array_equal(a.failures, c.failures)  # common random numbers
    d = simulate(Scenario.build(prof, 4096, 5.0, strategy(prof, "sync", 4096)), 30, seed=8)
    assert not np.array_equal(a.failures, d.failures)


def test_no_failures_means_only_checkpoint_stalls():
    st = Strategy(name="s", stall_s=10.0, load_s=5.0, interval_s=990.0)
    r = simulate(one(0.0, st), 5, seed=0)
    assert (r.failures == 0).all()
    np.testing.assert_allclose(r.ettr, 0.99, rtol=1e-3)
    assert r.badput["recompute"].sum() == 0


def test_async_persist_window_loses_the_previous_interval():
    # A failure before the newest checkpoint has persisted falls back to the one before it.
    rate = 1 / 3600.0
    fast = Strategy(name="a", stall_s=1.0, persist_s=0.0, load_s=0.0, interval_s=600.0)
    slow = replace(fast, persist_s=500.0)
    lost_fast = simulate(one(rate, fast), 200, seed=2).badput["recompute"].mean()
    lost_slow = simulate(one(rate, slow), 200, seed=2).badput["recompute"].mean()
    n = simulate(one(rate, fast), 200, seed=2).failures.mean()
    # Each failure loses on average ~half an interval, plus the persist window in ~500/601 of cases.
    assert lost_slow > lost_fast
    assert (lost_slow - lost_fast) / n == pytest.approx(500.0, rel=0.15)


def test_planned_interruptions_lose_no_work():
    st = Strategy(name="s", stall_s=5.0, persist_s=20.0, load_s=30.0, interval_s=600.0)
    sc = replace(one(0.0, st), planned_rate=1 / 3600.0, restart_s=60.0)
    r = simulate(sc, 50, seed=3)
    assert r.planned.mean() == pytest.approx(H / 3600.0, rel=0.05)
    assert r.badput["recompute"].sum() == 0 and r.badput["planned"].mean() > 0


def test_hot_spares_turn_requeues_into_swaps():
    # One failure every 2 days, each node 7 days in repair: ~3.5 nodes out at any time.
    base = Strategy(name="s", stall_s=5.0, load_s=30.0, interval_s=600.0)
    kw = dict(
        replace=True, spare_swap_s=120.0, requeue_s=1800.0, repair_s=7 * 86400.0, horizon_s=200 * 86400.0
    )
    rate = 1 / (2 * 86400.0)
    runs = {n: simulate(one(rate, replace(base, hot_spares=n), **kw), 100, seed=4) for n in (0, 1, 20)}
    per = {n: r.badput["replace"].sum() / r.failures.sum() for n, r in runs.items()}
    # (a failure during a swap or requeue cuts it short, ~1% of them here)
    assert per[0] == pytest.approx(1800.0, rel=0.02)
    assert per[20] == pytest.approx(120.0, rel=0.02)
    assert per[20] < per[1] < per[0]


def test_peer_memory_and_in_process_restart_shrink_recompute_load_and_restart():
    prof = load_profile("llama3-h100")
    plain = strategy(prof, "gpufleet-async", 16384, interval_s=1800.0)
    peer = strategy(prof, "peer-inproc", 16384, interval_s=1800.0)
    a = simulate(Scenario.build(prof, 16384, 20.0, plain), 100, seed=5)
    b = simulate(Scenario.build(prof, 16384, 20.0, peer), 100, seed=5)
    for k in ("load", "restart"):
        assert b.badput[k].mean() < a.badput[k].mean()
    assert b.ettr.mean() > a.ettr.mean()


def test_lemon_exclusion_caps_each_lemons_failures():
    prof = load_profile("rsc-a100").with_lemons(0.02, 100.0)
    st = strategy(prof, "sync", 4096)
    keep = simulate(Scenario.build(prof, 4096, 30.0, st), 50, seed=6)
    out = simulate(Scenario.build(prof, 4096, 30.0, replace(st, lemon_k=3)), 50, seed=6)
    lemons = out.extra["lemons"]
    assert lemons.mean() == pytest.approx(512 * 0.02, rel=0.15)
    # A lemon fails ~0.65 times a day here: in 30 days nearly every one reaches K = 3 and is excluded.
    assert (out.by_source["lemon"] <= 3 * lemons).all()
    assert (out.by_source["lemon"] == 3 * lemons).mean() > 0.9
    assert out.by_source["lemon"].mean() < keep.by_source["lemon"].mean() / 3
    np.testing.assert_array_equal(out.by_source["base"], keep.by_source["base"])


def test_screening_removes_early_life_failures():
    prof = load_profile("llama3-h100")
    prof = prof.model_copy(update={"early_life": prof.early_life.model_copy(update={"probability": 0.2})})
    st = strategy(prof, "sync", 16384)
    raw = simulate(Scenario.build(prof, 16384, 20.0, st), 50, seed=7)
    screened = simulate(Scenario.build(prof, 16384, 20.0, replace(st, screening=0.9)), 50, seed=7)
    hw = raw.hw_failures.mean()
    assert raw.by_source["early"].mean() == pytest.approx(0.2 * hw, rel=0.15)
    assert screened.by_source["early"].mean() < 0.2 * raw.by_source["early"].mean()


def test_strategy_table_has_every_method_with_and_without_spares():
    prof = load_profile("llama3-h100")
    names = [s.name for s in strategies(prof, 16384)]
    assert names == [n for m in METHODS for n in (m, f"{m}+spares")]
    st = {s.name: s for s in strategies(prof, 16384)}
    assert st["sync"].stall_s > st["dcp-async"].stall_s > st["gpufleet-async"].stall_s
    assert st["peer-inproc+spares"].hot_spares == default_spares(16384, 8) == 21
    assert st["peer-inproc+spares"].lemon_k == 3 and st["sync"].lemon_k == 0

"""The spike guard on long runs (issue 9, part 6) and the rollback budget as a rate."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from gpufleet.core.ledger import Ledger, read_events
from gpufleet.train.rollback import RollbackPlanner
from gpufleet.train.spike import SpikeGuard


def converging_losses(n: int = 16_000, seed: int = 0) -> list[float]:
    """A loss curve like the issue's GRU language model: 4.2 at the start, ~0.02 once converged.

    Per-batch noise is multiplicative (log-normal): sigma 0.1 while the loss falls, growing to 0.35
    once converged, where a few hard batches dominate. One batch in 400 is a hard one, up to 0.17
    above the level: the blips the issue saw on the converged model (0.1692 and 0.083 against a
    median of 0.022, up to 8x the level there). The recorded GRU curve (``recorded_losses``) has a
    robust noise of ~0.06 in log units while it falls and ~0.1 on its plateau: 0.35 is a stress level.
    """
    rng = random.Random(seed)
    out = []
    for t in range(n):
        e = math.exp(-t / 600)
        level = 0.02 + 4.18 * e
        sigma = 0.35 - 0.25 * min(1.0, 10 * e)
        x = level * math.exp(rng.gauss(0.0, sigma))
        if rng.random() < 1 / 400:
            x += rng.uniform(0.04, 0.17)
        out.append(x)
    return out


def recorded_losses() -> list[float]:
    """6000 per-step losses of benchmarks/scripts/gru_lm.py's model, recorded in one process (2-layer
    GRU, d=96, dropout 0.1, AdamW at a constant 3e-3, batches of 16 x 32 characters of the first 1500
    of Shakespeare, seed 0): 3.9 falling to a plateau near 0.1, with its real batch-to-batch noise."""
    return json.loads((Path(__file__).parent / "data" / "gru_losses.json").read_text())


def _feed(g: SpikeGuard, values: list[float]) -> list[int]:
    return [i for i, v in enumerate(values) if g.check(v) is not None]


def test_the_issues_false_alarms_are_not_spikes():
    g = SpikeGuard()
    _feed(g, [4.2 - 0.01 * i for i in range(20)])  # the run's loss scale: ~4.1
    noise = [0.02255 + 0.0004 * math.sin(i) for i in range(50)]  # converged: a tiny MAD
    assert _feed(g, noise) == []
    assert g.check(0.1692) is None  # robust z ~ 59, but 0.15 above the median of a 4.1-scale run
    assert g.check(0.083) is None
    old = SpikeGuard(level_frac=0.0)  # the previous rule: z and min_rel only
    _feed(old, [4.2 - 0.01 * i for i in range(20)] + noise)
    assert "robust z=" in (old.check(0.1692) or "")


def test_a_long_converging_run_raises_no_alarm():
    losses = converging_losses()
    assert max(b / a for a, b in zip(losses, losses[1:], strict=False) if a < 0.05) > 7  # hard batches exist
    assert _feed(SpikeGuard(), losses) == []


@pytest.mark.parametrize("seed", [1, 2])
def test_injected_spikes_and_nans_are_caught_20_of_20(seed):
    """20 faults at random steps across the curve (after the guard's 10-step warm-up), as the fault
    drills inject them: ``spike`` multiplies the loss by 100 (its default factor), ``nan`` makes it NaN.
    After each, the replay feeds the real loss again, which must pass (a transient fault)."""
    losses = converging_losses(seed=seed)
    rng = random.Random(seed)
    steps = set(rng.sample(range(10, len(losses)), 20))
    kinds = {s: rng.choice(["spike", "nan", "inf"]) for s in steps}
    g = SpikeGuard()
    caught = []
    for i, v in enumerate(losses):
        if i in steps:
            bad = {"spike": v * 100, "nan": math.nan, "inf": math.inf}[kinds[i]]
            if g.check(bad) is not None:
                caught.append(i)
        assert g.check(v) is None, f"step {i}: a normal loss flagged"
    assert sorted(caught) == sorted(steps)


@pytest.mark.parametrize("seed", [3, 4])
def test_on_a_recorded_gru_loss_curve_no_alarm_and_20_of_20_drills_caught(seed):
    losses = recorded_losses()
    assert losses[0] > 3.5 and max(losses[-1000:]) < 0.2
    assert _feed(SpikeGuard(), losses) == []
    rng = random.Random(seed)
    steps = set(rng.sample(range(10, len(losses)), 20))
    g, caught = SpikeGuard(), []
    for i, v in enumerate(losses):
        if i in steps and g.check(v * 100 if i % 2 else math.nan) is not None:
            caught.append(i)
        assert g.check(v) is None
    assert sorted(caught) == sorted(steps)


def test_divergence_back_towards_the_starting_loss_is_caught_on_a_converged_model():
    g = SpikeGuard()
    losses = converging_losses(6000)
    _feed(g, losses)
    assert g.level is not None and g.level > 3.5
    assert "loss spike" in (g.check(2.0) or "")  # half-way back to the start
    assert "loss spike" in (g.check(0.02 + 0.5) or "")  # +0.5 (floor: 0.1 x the run's scale)


def test_level_is_saved_and_old_checkpoints_still_load():
    g = SpikeGuard()
    _feed(g, converging_losses(3000))
    g2 = SpikeGuard()
    g2.load_state_dict(g.state_dict())
    assert g2.level == g.level and g2.check(0.3) is None and g.check(0.3) is None
    old = SpikeGuard()
    old.load_state_dict({"history": [1.0] * 20})  # saved before the guard had a level
    assert old.level == 1.0


def test_bad_guard_settings():
    with pytest.raises(ValueError):
        SpikeGuard(level_frac=-0.1)


# -- rollback budget: a rate ------------------------------------------------------------------------
def _planner(tmp_path) -> tuple[RollbackPlanner, Ledger]:
    return RollbackPlanner(tmp_path, window=50), Ledger(tmp_path, session="t")


def test_rollback_budget_is_a_rate_over_steps(tmp_path):
    rb, ledger = _planner(tmp_path)
    for step in (500, 500, 4000, 4000, 9000, 9000, 15_000, 15_000):  # a data-driven spike now and then
        rb.plan(step, ledger, attempt=0)
        assert rb.over_budget(3, 1000) is None
    assert rb.count == 8
    rb.plan(15_400, ledger, attempt=0)  # a third and fourth rollback within 1000 steps
    assert rb.over_budget(3, 1000) is None
    rb.plan(15_400, ledger, attempt=0)
    why = rb.over_budget(3, 1000)
    assert why is not None and "more than 3 rollbacks within 1000 steps" in why and "15400" in why


def test_rollback_window_zero_counts_the_whole_run(tmp_path):
    rb, ledger = _planner(tmp_path)
    for step in (500, 4000, 9000):
        rb.plan(step, ledger, attempt=0)
    assert rb.over_budget(3, 0) is None
    rb.plan(15_000, ledger, attempt=0)
    assert "more than 3 rollbacks in this run" in (rb.over_budget(3, 0) or "")


def test_a_reproduced_spike_is_recorded_as_data_driven(tmp_path):
    rb, ledger = _planner(tmp_path)
    rb.plan(300, ledger, attempt=0)
    rb.plan(300, ledger, attempt=1)
    ledger.close()
    first, second = [e for e in read_events(tmp_path) if e["ev"] == "rollback"]
    assert first["mode"] == "replay" and not first["data_driven"]
    assert second["mode"] == "skip" and second["data_driven"] and "data-driven" in second["reason"]


def test_a_spike_early_in_training_while_the_loss_falls_fast():
    """The first 30 losses of tests/integration/scripts/toy_train.py: the window spreads with the
    trend (13 -> 1), so only the noise estimate from successive differences keeps x1000 an outlier."""
    toy = [13.0, 10.7, 9.69, 12.4, 10.5, 6.33, 11.6, 5.81, 12.8, 7.41, 8.92, 5.70, 5.29, 6.46, 4.92]
    toy += [8.19, 3.08, 6.60, 4.89, 3.55, 3.13, 2.95, 2.19, 4.87, 2.33, 1.84, 1.91, 1.83, 1.30, 1.02]
    g = SpikeGuard()
    assert _feed(g, toy) == []
    assert "loss spike" in (g.check(1.02 * 1000) or "")
    assert g.check(1.1) is None

"""The restart budget is a rate over steps, like the rollback budget (a long run must not die of it)."""

from __future__ import annotations

from gpufleet.train.supervisor import restart_budget_spent


def test_a_crash_loop_at_one_step_uses_the_budget_up():
    steps: list[int] = []
    for _ in range(3):
        assert restart_budget_spent(steps, 40, max_restarts=3, window=1000) is None
        steps.append(40)
    why = restart_budget_spent(steps, 40, max_restarts=3, window=1000)
    assert why is not None and "restart budget of 3" in why and "3 restarts" in why


def test_a_long_run_with_regular_failures_never_does():
    steps: list[int] = []
    for step in range(500, 100_000, 3000):  # a kill every ~3000 steps, as in the soak
        assert restart_budget_spent(steps, step, max_restarts=3, window=1000) is None
        steps.append(step)
    assert len(steps) > 30


def test_window_zero_is_the_lifetime_count():
    steps = [100, 5000, 90_000]
    assert restart_budget_spent(steps, 200_000, max_restarts=3, window=0) is not None
    assert restart_budget_spent(steps[:2], 200_000, max_restarts=3, window=0) is None


def test_failures_near_each_other_count_together_whichever_side():
    # a rollback can move the failure step back: the distance counts, not the order
    assert restart_budget_spent([900, 1100], 1000, max_restarts=2, window=1000) is not None
    assert restart_budget_spent([100, 1900], 1000, max_restarts=2, window=500) is None

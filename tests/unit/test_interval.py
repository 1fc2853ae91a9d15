"""Checkpoint interval policy: Young/Daly values, spec parsing, auto convergence."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from gpufleet.core.errors import ConfigError
from gpufleet.reliability.interval import (
    BOOTSTRAP_STEPS,
    DEFAULT_MTBF_S,
    IntervalPolicy,
    daly,
    expected_goodput,
    optimal_goodput,
    young,
)

MIN, H = 60.0, 3600.0


@pytest.mark.parametrize(("mtbf", "minutes"), [(24 * H, 117), (6 * H, 57), (15 * MIN, 9.1)])
def test_daly_sanity_values(mtbf: float, minutes: float) -> None:
    # Daly 2004 sanity values for a 5-minute checkpoint cost, within rounding.
    assert daly(5 * MIN, mtbf) / MIN == pytest.approx(minutes, abs=0.5 if minutes > 10 else 0.05)


def test_young_and_daly_edges() -> None:
    assert young(300.0, 6 * H) == pytest.approx(math.sqrt(2 * 300 * 6 * H))
    assert daly(300.0, 6 * H) < young(300.0, 6 * H)
    assert daly(3 * H, 1 * H) == 1 * H  # δ ≥ 2M: τ = M
    assert daly(0.0, H) == 0.0 and young(0.0, H) == 0.0
    assert daly(1.0, 0.0) == 0.0


@pytest.mark.parametrize(
    ("spec", "mode", "steps", "secs"),
    [
        ("100", "steps", 100, None),
        ("100steps", "steps", 100, None),
        ("1 step", "steps", 1, None),
        ("90s", "time", None, 90.0),
        ("5m", "time", None, 300.0),
        ("1.5h", "time", None, 5400.0),
        ("10min", "time", None, 600.0),
        (" AUTO ", "auto", None, None),
    ],
)
def test_parse_valid(spec: str, mode: str, steps: int | None, secs: float | None) -> None:
    p = IntervalPolicy.parse(spec)
    assert (p.mode, p.every_steps, p.every_s) == (mode, steps, secs)


@pytest.mark.parametrize("spec", ["", "0", "-5", "abc", "5x", "0s", "autox", "1e3", "5 m s"])
def test_parse_invalid(spec: str) -> None:
    with pytest.raises(ConfigError) as ei:
        IntervalPolicy.parse(spec)
    msg = str(ei.value)
    assert "\n" not in msg and "auto" in msg and "90s" in msg and "Nsteps" in msg


def test_parse_bad_mtbf() -> None:
    with pytest.raises(ConfigError):
        IntervalPolicy.parse("auto", mtbf_s=0.0)


def test_fixed_steps_due() -> None:
    p = IntervalPolicy.parse("3")
    assert not p.due(10, 0.0)  # first call: counting starts at the resume step
    due = [s for s in range(11, 20) if p.due(s, 0.0) and (p.saved(s, 0.0) or True)]
    assert due == [13, 16, 19]
    assert p.observe(stall_s=1.0, step_s=0.1) is None
    assert p.decision()["policy"] == "steps" and p.decision()["every_steps"] == 3


def test_fixed_time_due() -> None:
    p = IntervalPolicy.parse("90s")
    assert not p.due(0, 1000.0)
    assert not p.due(5, 1089.0)
    assert p.due(6, 1090.0)
    p.saved(6, 1090.0)
    assert not p.due(6, 2000.0)  # never twice at one boundary
    assert p.due(7, 1180.0)


def test_auto_bootstrap_then_converges() -> None:
    mtbf = 2 * H
    p = IntervalPolicy.parse("auto", mtbf_s=mtbf)
    assert not p.due(0, 0.0)
    # Bootstrap: first checkpoint after a few steps, before any stall is measured.
    firsts = [s for s in range(1, 20) if p.due(s, 0.0)]
    assert firsts[0] == BOOTSTRAP_STEPS
    p.saved(BOOTSTRAP_STEPS, 0.0)
    decisions = []
    for i in range(200):
        d = p.observe(step_s=0.5 + 0.01 * (i % 3), stall_s=2.0 if i % 10 == 0 else None)
        if d:
            decisions.append(d)
    expected_tau = daly(2.0, mtbf)
    assert decisions, "auto must publish a decision once δ and the step time are measured"
    d = decisions[-1]
    assert d["policy"] == "auto" and d["model"] == "daly"
    assert d["delta_s"] == pytest.approx(2.0) and d["mtbf_s"] == mtbf
    assert d["every_s"] == pytest.approx(expected_tau)
    assert d["every_steps"] == pytest.approx(expected_tau / 0.51, rel=0.05)
    assert len(decisions) == 1  # steady measurements: no flapping
    # one noisy stall does not move the robust average; a sustained change does
    assert p.observe(stall_s=50.0) is None
    changed = [p.observe(stall_s=8.0) for _ in range(9)]
    assert any(changed)
    assert p.decision()["every_steps"] == pytest.approx(daly(8.0, mtbf) / 0.51, rel=0.05)


def test_auto_respects_persist_and_one_step() -> None:
    p = IntervalPolicy.parse("auto", mtbf_s=H)
    d = p.observe(stall_s=0.0, step_s=0.2, persist_s=10.0)  # async: near-zero stall
    assert d is not None and d["every_s"] == pytest.approx(12.5)  # 1.25 × persist
    assert d["every_steps"] == round(12.5 / 0.2)
    q = IntervalPolicy.parse("auto", mtbf_s=H)
    d = q.observe(stall_s=0.0, step_s=5.0)
    assert d is not None and d["every_steps"] == 1


def test_auto_charges_the_persist_interference() -> None:
    # Clean steps take 0.10 s, steps overlapping a 0.6 s persist 0.15 s: one persist spans 4 such
    # steps and costs them 4 × 0.05 = 0.2 s of training, far more than its 0.01 s stall.
    mtbf = 600.0
    p = IntervalPolicy.parse("auto", mtbf_s=mtbf)
    p.observe(stall_s=0.01, persist_s=0.6)
    for i in range(12):
        p.observe(step_s=0.15 if i % 3 == 0 else 0.10, overlapped=i % 3 == 0)
    d = p.decision()
    assert d["interference_s"] == pytest.approx(0.2)
    assert d["every_s"] == pytest.approx(daly(0.01 + 0.2, mtbf))
    # without overlap information (or with no slowdown) only the stall counts, as before
    q = IntervalPolicy.parse("auto", mtbf_s=mtbf)
    q.observe(stall_s=0.01, persist_s=0.6)
    for _ in range(12):
        q.observe(step_s=0.10)
    assert q.decision()["interference_s"] == 0.0
    assert q.decision()["every_s"] == pytest.approx(max(daly(0.01, mtbf), 1.25 * 0.6))
    assert d["every_steps"] > q.decision()["every_steps"]


def test_auto_default_and_updated_mtbf() -> None:
    p = IntervalPolicy.parse("auto")
    d = p.observe(stall_s=1.0, step_s=1.0)
    assert d is not None and d["mtbf_s"] == DEFAULT_MTBF_S and d["mtbf_source"] == "default"
    d2 = p.set_mtbf(60.0)
    assert d2 is not None and d2["every_steps"] < d["every_steps"]


def test_goodput_model() -> None:
    delta, mtbf, r = 10.0, H, 30.0
    best = optimal_goodput(delta, mtbf, r)
    assert best == pytest.approx(1 - math.sqrt(2 * delta / mtbf) - r / mtbf)
    tau = young(delta, mtbf)
    for f in (0.5, 0.8, 1.25, 2.0):  # the optimum beats nearby intervals
        assert expected_goodput(tau * f, delta, mtbf, r) < best
    assert optimal_goodput(delta, mtbf, r, persist_s=1000.0) < best
    assert optimal_goodput(delta, 0.0) == 0.0


def test_import_is_light() -> None:
    code = "import sys, gpufleet.reliability.interval; print('torch' in sys.modules, 'numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]

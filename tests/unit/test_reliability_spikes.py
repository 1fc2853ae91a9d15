"""The report's loss-spike section: alarms by kind and outcome, and false alarms (docs/reliability.md)."""

from __future__ import annotations

import io

from rich.console import Console

from gpufleet.reliability.metrics import spike_stats, summarize
from gpufleet.reliability.render import render
from gpufleet.reliability.synth import LedgerBuilder


def _to_spike(b: LedgerBuilder, step: int) -> LedgerBuilder:
    return b.steps(step - b.next_step)


def _drill(b: LedgerBuilder, kind: str = "spike") -> LedgerBuilder:
    """A nan/spike drill firing at the next step, on both ranks, as the workers report it."""
    for rank in (0, 1):
        b.emit(
            "inject",
            rank=rank,
            attempt=b.attempt,
            kind=kind,
            fault_id=0,
            step=b.next_step,
            spec=f"{kind}:step={b.next_step},persist=1",
            persist=True,
        )
    return b


def _run(value: float | None, again: bool = False, replay_value: float | None = None, drill: bool = False):
    """A spike at step 15; ``again``: the replay hits it there too, with ``replay_value`` (then skip)."""
    b = LedgerBuilder().start().steps(10).checkpoint().steps(5)
    if drill:
        _drill(b)
    b.fail("spike", spike_value=value).recover(rollback="replay")
    _to_spike(b, 15)
    if again:
        if drill:
            _drill(b)
        b.fail("spike", spike_value=replay_value).recover(rollback="skip")
    return b.steps(10).end()


def test_transient_spike_is_a_caught_fault_not_a_false_alarm():
    s = spike_stats(_run(1e6).events)
    assert s["flagged"] == 1 and s["injected"] == 0
    assert s["outcome"] == {"transient": 1, "data_driven": 0, "unresolved": 0}
    assert s["false_alarms"] == 0 and s["alarms"][0]["step"] == 15


def test_a_finite_spike_the_replay_reproduced_is_a_false_alarm():
    """The issue's case: 0.1692 on a converged model, replayed to exactly 0.1692; its batches skipped."""
    s = spike_stats(_run(0.1692, again=True, replay_value=0.1692).events)
    assert s["outcome"] == {"transient": 0, "data_driven": 1, "unresolved": 0}
    assert s["identical"] == 1 and s["false_alarms"] == 1
    a = s["alarms"][0]
    assert a["value"] == a["replay_value"] == 0.1692 and a["false_alarm"]


def test_reproduced_nan_and_drills_are_not_false_alarms():
    # a batch that gives NaN every time: never a valid loss
    nan = spike_stats(_run(None, again=True, replay_value=None).events)
    assert nan["outcome"]["data_driven"] == 1 and nan["non_finite"] == 1 and nan["identical"] == 1
    assert nan["false_alarms"] == 0
    # --inject spike:step=15,persist=1
    drill = spike_stats(_run(1e6, again=True, replay_value=1e6, drill=True).events)
    assert drill["injected"] == 1 and drill["outcome"]["data_driven"] == 1 and drill["false_alarms"] == 0


def test_a_spike_with_no_replay_yet_is_unresolved():
    b = LedgerBuilder().start().steps(10).checkpoint().steps(5).fail("spike")
    s = spike_stats(b.events)
    assert s["outcome"]["unresolved"] == 1 and s["false_alarms"] == 0


def test_report_json_and_terminal_show_spikes_and_false_alarms():
    summary = summarize(_run(0.1692, again=True, replay_value=0.1692).events)
    assert summary["spikes"]["false_alarms"] == 1
    con = Console(file=io.StringIO(), width=200, color_system=None)
    render(summary, console=con)
    out = con.file.getvalue()
    assert "loss spikes" in out and "1 data-driven" in out and "false alarms 1" in out
    quiet = summarize(LedgerBuilder().start().steps(5).end().events)
    assert quiet["spikes"]["flagged"] == 0 and quiet["spikes"]["false_alarms"] == 0

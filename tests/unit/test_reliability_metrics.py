"""Reliability math over synthetic ledgers with hand-computed answers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpufleet.core.ledger import read_events
from gpufleet.reliability import metrics
from gpufleet.reliability.synth import LedgerBuilder
from gpufleet.reliability.walk import walk


def two_failures() -> LedgerBuilder:
    """Hand-computed scenario (times relative to run_start):

    attempt 0: init 2 s, steps 0-4 (1 s each), checkpoint @5 (stall 0.2 s in step 5), steps 5-9,
      crash happens at 12.5, detected 13.0, torn down 14.0
    attempt 1: ready 16, restore @5 (load 1 s) at 17, steps 5-9 (first at 18), checkpoint @10,
      steps 10-14 (last at 27.2), spike at 27.2, torn down 28.2
    attempt 2: ready 29.2, rollback + restore @10 at 30.2, steps 10-19 (first at 31.2, last 40.2)
    run_end at 41.2.
    """
    b = LedgerBuilder(t0=1000.0)
    b.start(init_s=2.0, load_s=0.0)
    b.steps(5).checkpoint(stall_s=0.2).steps(5)
    b.fail("crash", detect_s=0.5, teardown_s=1.0, lag_s=0.3)
    b.recover(init_s=2.0, load_s=1.0)
    b.steps(5).checkpoint(stall_s=0.2).steps(5)
    b.fail("spike", detect_s=0.0, teardown_s=1.0, rank=0)
    b.recover(init_s=1.0, load_s=1.0, rollback=True)
    b.steps(10)
    b.end("completed")
    return b


def test_goodput_badput_hand_computed() -> None:
    ev = two_failures().events
    assert metrics.wall_time(ev) == pytest.approx(41.2)
    assert metrics.goodput(ev) == pytest.approx(20.0 / 41.2)
    bp = metrics.badput(ev)
    expected = {
        "productive": 20.0,
        "ckpt_stall": 0.4,
        "detect": 0.5,
        "teardown": 2.0,
        "spawn_init": 5.0,  # startup 2 + recoveries 2 + 1
        "load": 2.0,
        "recompute": 10.0,  # steps 5-9 of attempt 0 and 10-14 of attempt 1
        "idle": 1.3,  # 0.3 s of the step the crash interrupted, 1.0 s before run_end
    }
    assert bp == pytest.approx(expected)
    assert sum(bp.values()) == pytest.approx(41.2)


def test_mttr_mtbf_hand_computed() -> None:
    ev = two_failures().events
    m = metrics.mttr(ev)
    assert m["count"] == 2
    assert m["mean_s"] == pytest.approx((5.5 + 4.0) / 2)
    assert m["max_s"] == pytest.approx(5.5)
    assert m["phases_mean_s"] == pytest.approx(
        {"detect": 0.25, "teardown": 1.0, "spawn_init": 1.5, "load": 1.0, "first_step": 1.0}
    )
    assert m["recompute_mean_s"] == pytest.approx(5.0)
    mtbf, uptime, n = metrics.mtbf(ev)
    assert n == 2
    assert uptime == pytest.approx(41.2 - 9.5)
    assert mtbf == pytest.approx((41.2 - 9.5) / 2)
    assert metrics.failures_by_cause(ev) == {"crash": 1, "spike": 1}


def test_incident_phases_sum_to_mttr() -> None:
    w = walk(two_failures().events)
    assert len(w.incidents) == 2
    for inc in w.incidents:
        assert inc.recovered
        assert sum(inc.phases().values()) == pytest.approx(inc.mttr)
        assert inc.lost_steps == 5
    assert [x.wasted for x in w.steps].count(True) == 10


def test_summary_json_keys_and_serialisable() -> None:
    s = metrics.summarize(two_failures().events, run_dir="/x")
    json.dumps(s)
    for k in (
        "schema", "run_dir", "sessions", "wall_s", "uptime_s", "productive_s", "goodput", "steps",
        "badput", "failures", "mtbf_s", "mttr", "incidents", "restarts", "rollbacks", "restores",
        "worker_init_s", "checkpoints", "interval",
    ):  # fmt: skip
        assert k in s, k
    assert s["schema"] == metrics.SCHEMA
    assert set(s["badput"]) == {"productive", *metrics.BADPUT_CATEGORIES}
    steps = {"executed": 30, "productive": 20, "rolled_back": 10, "last_step": 19}
    assert s["steps"] == steps | {"mean_step_s": pytest.approx(1.0)}
    assert s["restarts"] == 2 and s["rollbacks"] == 1 and s["restores"] == 3
    ck = s["checkpoints"]
    assert ck["committed"] == 2 and ck["failed"] == 0 and ck["last_committed_step"] == 10
    assert ck["stall_s"]["max"] == pytest.approx(0.2)
    assert s["failures"] == {"count": 2, "by_cause": {"crash": 1, "spike": 1}, "unrecovered": 0}


def test_sessions_span_and_roll_back_earlier_session(tmp_path: Path) -> None:
    b = LedgerBuilder(t0=0.0)
    b.start(init_s=1.0).steps(4).checkpoint(stall_s=0.0).steps(3)  # commit @4, steps 4-6 unsaved
    b.fail("hang", detect_s=5.0, teardown_s=2.0)
    b.end("max_restarts", exit_code=4, after_s=0.0)  # no recovery in this session
    wall1 = b.t - 0.0
    b.new_session("s2", gap_s=500.0)
    s2_start = b.t
    b.start(init_s=1.0, load_s=0.5)  # resumes @4: session 1's steps 4-6 are rolled back
    b.steps(6).end("completed", after_s=0.5)
    wall2 = b.t - s2_start
    b.write(tmp_path, torn_tail=True)
    ev = read_events(tmp_path)
    assert len(ev) == len(b.events)  # torn last line ignored
    s = metrics.summarize(ev)
    assert len(s["sessions"]) == 2
    assert s["wall_s"] == pytest.approx(wall1 + wall2)  # the 500 s gap is not wall time
    assert s["steps"]["rolled_back"] == 3
    assert s["productive_s"] == pytest.approx(4 + 6)
    assert s["failures"]["unrecovered"] == 1
    assert s["mttr"]["count"] == 0 and s["mttr"]["mean_s"] is None
    # unrecovered: downtime runs to the session end (detect 5 + teardown 2)
    assert s["uptime_s"] == pytest.approx(wall1 + wall2 - 7.0)
    assert s["badput"]["detect"]["s"] == pytest.approx(5.0)
    assert sum(v["s"] for v in s["badput"].values()) == pytest.approx(s["wall_s"])


def test_secondary_failure_same_attempt_not_counted() -> None:
    b = LedgerBuilder(t0=0.0)
    b.start().steps(3)
    b.fail("crash", detect_s=0.1, teardown_s=0.0)
    b.emit("failure", cause="crash", rank=0, exit_code=1, attempt=0)  # the other rank, same incident
    b.wait(1.0).emit("teardown", attempt=0, teardown_s=1.0)
    b.recover().steps(2).end()
    s = metrics.summarize(b.events)
    assert s["failures"]["count"] == 1
    assert s["incidents"][0]["secondary_failures"] == 1
    assert s["incidents"][0]["phases_s"]["teardown"] == pytest.approx(1.0)


def test_hang_happened_from_detect_s_without_happened_t() -> None:
    b = LedgerBuilder(t0=0.0)
    b.start().steps(3)
    b.wait(30.0).emit("failure", cause="hang", rank=1, step=3)
    b.emit("detected", cause="hang", detect_s=30.0)
    b.recover(init_s=1.0, load_s=0.0).steps(1).end()
    inc = metrics.summarize(b.events)["incidents"][0]
    assert inc["phases_s"]["detect"] == pytest.approx(30.0)
    assert inc["mttr_s"] == pytest.approx(30.0 + 1.0 + 1.0)


def spike_replay_then_skip() -> LedgerBuilder:
    """Steps 0-1, commit @2, steps 2-5; the loss spikes at step 6 (attempt 0): replay from @2, steps
    2-5 again, the spike recurs at 6 (attempt 1): roll back to @2 and skip [2, 7); attempt 2 restores
    @2, skips to 7 and runs steps 7-9."""
    b = LedgerBuilder(t0=0.0)
    b.start().steps(2).checkpoint(stall_s=0.0).steps(4)
    b.fail("spike", detect_s=0.0, teardown_s=0.5, rank=0).recover(init_s=1.0, load_s=0.5, rollback="replay")
    b.steps(4)
    b.fail("spike", detect_s=0.0, teardown_s=0.5, rank=0).recover(init_s=1.0, load_s=0.5, rollback="skip")
    return b.steps(3).end()


def test_spike_rollbacks_and_skipped_window_as_emitted() -> None:
    b = spike_replay_then_skip()
    kinds = [e["ev"] for e in b.events]
    assert kinds.count("spike") == 2 and kinds.count("rollback") == 2 and kinds.count("skip") == 1
    (skip,) = [e for e in b.events if e["ev"] == "skip"]
    assert (skip["skipped_from"], skip["skipped_to"]) == (2, 7)  # what rank 0 emits: no `rollback`
    s = metrics.summarize(b.events)
    assert s["failures"] == {"count": 2, "by_cause": {"spike": 2}, "unrecovered": 0}
    assert s["rollbacks"] == 2 and s["skipped_windows"] == 1 and s["skipped_steps"] == 5
    assert s["steps"]["productive"] == 5  # 0-1 and 7-9: the skipped batches never ran
    assert s["steps"]["rolled_back"] == 8  # 2-5, twice
    assert s["badput"]["recompute"]["s"] == pytest.approx(8.0)
    assert s["badput"]["load"]["s"] == pytest.approx(1.0)


def test_a_window_skipped_again_counts_once() -> None:
    b = spike_replay_then_skip()
    b.new_session("s2").start(load_s=0.5)  # resumes @2 again: the same window is skipped again
    b.steps(1).end()
    assert [e["ev"] for e in b.events].count("skip") == 2
    s = metrics.summarize(b.events)
    assert s["skipped_windows"] == 1 and s["skipped_steps"] == 5


def test_mtbf_history(tmp_path: Path) -> None:
    assert metrics.mtbf_history([], configured=3600.0) == 3600.0
    b = LedgerBuilder(t0=0.0)
    b.start().steps(10).end()
    assert metrics.mtbf_history(b.events) is None
    assert metrics.mtbf_history(b.events, configured=7.0) == 7.0
    b2 = two_failures()
    b2.write(tmp_path)
    assert metrics.mtbf_history(tmp_path) == pytest.approx((41.2 - 9.5) / 2)
    assert metrics.mtbf_history(b2.events, configured=1e6) == pytest.approx((41.2 - 9.5) / 2)


def test_empty_and_standalone_ledgers() -> None:
    s = metrics.summarize([])
    assert s["wall_s"] == 0 and s["goodput"] is None and s["mtbf_s"] is None
    # standalone (no supervisor): steps only
    b = LedgerBuilder(t0=0.0)
    for i in range(3):
        b.wait(1.0).emit("step", step=i, dt=1.0, stall=0.0)
    s = metrics.summarize(b.events)
    assert s["wall_s"] == pytest.approx(3.0)  # first step's start to the last event
    assert s["goodput"] == pytest.approx(1.0)
    assert s["steps"]["executed"] == 3


def test_percentile() -> None:
    assert metrics.percentile([], 50) is None
    assert metrics.percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert metrics.percentile([5.0], 95) == 5.0


def in_place_crash(happened_at_detection: bool) -> LedgerBuilder:
    """Rank 1 dies at 8 s into attempt 0's steps; rank 0 noticed 0.15 s after (its abort took 0.05 s,
    so it was ready to rejoin at 0.2 s), the supervisor 0.5 s after, torn down 0.1 s later; the new
    round re-forms in 0.3 s, restores from rank 0's own memory in 0.02 s; its first step takes 1 s.
    ``happened_at_detection``: the supervisor dates the failure when it saw the process die (waitpid),
    later than the survivor noticed."""
    b = LedgerBuilder(t0=1000.0)
    b.start(init_s=2.0)
    b.steps(5).checkpoint(stall_s=0.0).steps(3)
    b.fail("crash", detect_s=0.5, teardown_s=0.1, rejoin_s=0.2, abort_s=0.05)
    if happened_at_detection:
        (failure,) = [e for e in b.events if e["ev"] == "failure"]
        failure["happened_t"] = failure["t"]
    b.recover(init_s=0.3, load_s=0.02, path="in_process", source="process")
    b.steps(5)
    b.end("completed")
    return b


@pytest.mark.parametrize("happened_at_detection", [False, True])
def test_in_place_phases_are_cut_where_the_events_fall(happened_at_detection: bool) -> None:
    (inc,) = walk(in_place_crash(happened_at_detection).events).incidents
    ph = inc.in_place_phases()
    assert ph is not None and inc.path == "in_process" and inc.restore_source == "process"
    assert inc.abort_s == pytest.approx(0.05)
    # The survivor left the round before the supervisor was done: its abort is off the critical path.
    # Dated by the supervisor, the failure happened 0.6 s before the lost rank was stopped; dated by
    # the survivor's notice (0.15 s after it really happened), 0.45 s.
    supervisor = 0.45 if happened_at_detection else 0.6
    assert ph == pytest.approx(
        {"supervisor": supervisor, "abort": 0.0, "rendezvous": 0.3, "restore": 0.02, "first_step": 1.0}
    )
    assert sum(ph.values()) == pytest.approx(inc.mttr)
    assert sum(inc.phases().values()) == pytest.approx(inc.mttr)


def test_a_hung_peers_survivor_aborts_after_the_supervisor_kills_it() -> None:
    b = LedgerBuilder(t0=1000.0)
    b.start(init_s=2.0)
    b.steps(5).checkpoint(stall_s=0.0).steps(3)
    b.fail("hang", detect_s=5.0, teardown_s=0.1, rejoin_s=5.3, abort_s=0.05)
    b.recover(init_s=0.5, load_s=0.02, path="in_process", source="process")
    b.steps(5)
    (inc,) = walk(b.events).incidents
    ph = inc.in_place_phases()
    assert ph == pytest.approx(
        {"supervisor": 5.1, "abort": 0.2, "rendezvous": 0.3, "restore": 0.02, "first_step": 1.0}
    )
    assert sum(ph.values()) == pytest.approx(inc.mttr)


def test_mttr_lists_in_process_recoveries_on_their_own() -> None:
    b = in_place_crash(happened_at_detection=True)
    b.steps(2).fail("crash", detect_s=0.5, teardown_s=1.0).recover(init_s=2.0, load_s=1.0)
    b.steps(3)
    m = metrics.mttr(b.events)
    assert m["count"] == 2
    ip = m["in_process"]
    assert ip["count"] == 1 and ip["restore_sources"] == {"process": 1}
    assert ip["mean_s"] == pytest.approx(1.77)
    assert sum(ip["phases_mean_s"].values()) == pytest.approx(ip["mean_s"])
    assert metrics.mttr(two_failures().events)["in_process"] is None
    incidents = metrics.summarize(b.events)["incidents"]
    assert [i["in_place_phases_s"] is None for i in incidents] == [False, True]

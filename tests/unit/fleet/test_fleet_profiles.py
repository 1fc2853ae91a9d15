"""Profiles (the papers' figures as data), user TOML errors, and --from-run calibration from a ledger."""

from __future__ import annotations

import pytest

from gpufleet.core.errors import ConfigError, UsageError
from gpufleet.fleet.calibrate import apply, from_run
from gpufleet.fleet.profiles import DAY_S, builtin_profiles, load_profile
from gpufleet.fleet.strategies import P1_GPUFLEET_OVER_DCP_STALL, strategy
from gpufleet.reliability.metrics import summarize
from gpufleet.reliability.synth import LedgerBuilder


def test_shipped_profiles_carry_the_published_figures():
    assert builtin_profiles() == ["llama3-h100", "rsc-a100"]
    ll = load_profile("llama3-h100")
    counts = {c.name: c.count for c in ll.cause}
    assert sum(counts.values()) == 419 and len(counts) == 18  # Table 5
    assert counts["Faulty GPU"] == 148 and counts["GPU HBM3 Memory"] == 72 and counts["Software Bug"] == 54
    total = sum(ll.cause_rate(c, 2048) for c in ll.cause) * 54 * DAY_S
    assert total == pytest.approx(419.0)
    assert ll.planned_rate() * 54 * DAY_S == pytest.approx(47.0)
    rsc = load_profile("rsc-a100")
    node = next(c for c in rsc.cause if c.per_node_day is not None)
    assert node.per_node_day == 6.5e-3
    # All causes at 1,024 GPUs: the 7.9 h the paper measured (the job-level rate was fitted to it).
    assert 1 / (sum(rsc.cause_rate(c, 128) for c in rsc.cause) * 3600) == pytest.approx(7.9, rel=0.01)


def test_user_profile_toml_and_its_errors(tmp_path):
    good = tmp_path / "mine.toml"
    good.write_text('name = "mine"\n[[cause]]\nname = "gpu"\nper_node_day = 0.01\n')
    p = load_profile(good)
    assert p.name == "mine" and p.hardware_node_rate() == pytest.approx(0.01 / DAY_S)
    cases = {
        "name = \n": "not valid TOML",
        'name = "x"\n': "cause",
        'name = "x"\n[[cause]]\nname = "a"\n': "exactly one of count",
        'name = "x"\n[[cause]]\nname = "a"\ncount = 3\n': "need [basis]",
        'name = "x"\nbogus = 1\n[[cause]]\nname = "a"\nper_job_day = 1\n': "bogus",
        'name = "x"\n[[cause]]\nname = "a"\nper_job_day = -1\n': "greater than or equal",
    }
    for text, needle in cases.items():
        f = tmp_path / "bad.toml"
        f.write_text(text)
        with pytest.raises(ConfigError) as e:
            load_profile(f)
        assert needle in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="valid: llama3-h100, rsc-a100"):
        load_profile("nope")


def test_from_run_takes_the_reports_numbers(tmp_path):
    b = LedgerBuilder(world_size=4)
    b.start(init_s=2.0).steps(10, dt=0.5).checkpoint(stall_s=0.02, persist_s=0.3).steps(10, dt=0.5)
    b.checkpoint(stall_s=0.04, persist_s=0.5).steps(5, dt=0.5)
    b.fail("crash", detect_s=1.5, teardown_s=0.5).recover(init_s=3.0, load_s=0.25).steps(10, dt=0.5).end()
    b.write(tmp_path)
    cal = from_run(tmp_path)
    rep = summarize(b.events)
    ph = rep["mttr"]["phases_mean_s"]
    assert cal.world_size == 4 and cal.incidents == 1 and cal.checkpoints == 2
    assert cal.detect_s == pytest.approx(ph["detect"]) and cal.detect_s == pytest.approx(1.5)
    assert cal.restart_s == pytest.approx(ph["teardown"] + ph["spawn_init"] + ph["first_step"])
    assert cal.load_s == pytest.approx(0.25)
    assert cal.stall_s == pytest.approx(0.03) and cal.persist_s == pytest.approx(0.4)
    assert cal.step_s == pytest.approx(rep["steps"]["mean_step_s"])
    prof = apply(load_profile("llama3-h100"), cal)
    assert prof.recovery.detect_s == pytest.approx(1.5) and prof.recovery.restart_s == cal.restart_s
    g = strategy(prof, "gpufleet-async", 100000, cal=cal)
    assert (g.stall_s, g.persist_s, g.load_s, g.min_interval_s) == (
        cal.stall_s,
        cal.persist_s,
        0.25,
        cal.step_s,
    )
    s = strategy(prof, "sync", 100000, cal=cal)
    assert s.stall_s == pytest.approx(cal.stall_s / P1_GPUFLEET_OVER_DCP_STALL + cal.persist_s)


def test_from_run_rejects_what_is_not_a_run_dir(tmp_path):
    with pytest.raises(UsageError, match="run directory not found"):
        from_run(tmp_path / "missing")
    with pytest.raises(UsageError, match="no ledger"):
        from_run(tmp_path)
    (tmp_path / "ledger.jsonl").write_text("")
    with pytest.raises(UsageError, match="holds no events"):
        from_run(tmp_path)


def test_bad_requests_are_config_errors():
    from gpufleet.fleet.simulate import FleetRequest, run

    for req, needle in (
        (FleetRequest(replicates=1), "--replicates"),
        (FleetRequest(days=0), "--days"),
        (FleetRequest(interval_s=-1.0), "--interval"),
        (FleetRequest(spares=-1), "--spares"),
        (FleetRequest(only=["foo"], sweep=False, replicates=2, gpus=8, days=0.1), "unknown strategy 'foo'"),
    ):
        with pytest.raises(ConfigError, match=needle):
            run(req)

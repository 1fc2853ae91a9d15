"""XID/SXID classes in the node state machine, the reputation and the operator-allowed actions.
Slurm is a pair of stand-in executables (``sinfo``, ``scontrol``) on PATH: the process boundary."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpufleet.core.errors import UsageError
from gpufleet.core.ledger import read_events
from gpufleet.health.fakes import FAKE_NVML_MODULE, data_path
from gpufleet.health.nodes import node_table, record_state
from gpufleet.health.passive import apply_report, report_remedy
from gpufleet.health.plans import parse_plan
from gpufleet.health.profiles import get_profile
from gpufleet.health.remediate import ACTABLE, parse_allow, remediate
from gpufleet.health.runner import run_plan

H = 3600.0


def report(kernel_log: str, node: str = "n1"):
    env = {
        "GPUFLEET_NVML_MODULE": FAKE_NVML_MODULE,
        "GPUFLEET_FAKE_NVML": str(data_path("nvml_h100_ok.json")),
        "GPUFLEET_KERNEL_LOG": str(data_path(kernel_log)),
    }
    plan = parse_plan(
        {"name": "t", "budget_s": 30, "checks": [{"name": "gpu.xid"}, {"name": "gpu.sxid"}]}, "t"
    )
    return run_plan(plan, get_profile("H100"), node=node, env=env)


def test_report_remedy_is_the_most_disruptive_failing_class():
    assert report_remedy(report("kern_xid79.log")) == "reboot"  # xid 79
    assert report_remedy(report("kern_sxid.log")) == "reboot"  # sxid 20034 (reboot) beats xid 74 (reset_gpu)
    assert report_remedy(report("kern_clean.log")) is None
    assert report_remedy(report("kern_sxid_nonfatal.log")) is None  # a WARN is no failure


def test_passive_transition_carries_the_remedy(tmp_path):
    tr = apply_report(report("kern_xid79.log"), tmp_path)
    assert tr is not None and tr["state"] == "suspect" and tr["remedy"] == "reboot"
    (e,) = read_events(tmp_path)
    assert e["ev"] == "node_state" and e["remedy"] == "reboot" and e["check"] == "gpu.xid"
    with pytest.raises(UsageError, match="unknown remedy 'frob'; valid: watch, drain"):
        record_state("n1", "suspect", "x", remedy="frob", fleet=tmp_path)


def test_a_reset_that_comes_back_escalates_to_service_and_makes_a_lemon(tmp_path):
    now = 100 * H
    rows = [
        ("healthy", None, 0),
        ("suspect", None, 1 * H),
        ("drained", "reset_gpu", 1.1 * H),  # the same failure, now classed: not a second one
        ("validated", None, 2 * H),
    ]
    for state, remedy, t in rows:
        record_state("n1", state, "r", remedy=remedy, fleet=tmp_path, t=t)
    (one,) = node_table(tmp_path, now=now)
    assert one.failures == 1 and one.remedy == "reset_gpu" and not one.lemon
    assert one.failures_by_remedy == {"reset_gpu": 1}
    record_state("n1", "drained", "r", remedy="reset_gpu", fleet=tmp_path, t=3 * H)
    (two,) = node_table(tmp_path, now=now)
    assert two.failures == 2 and two.remedy == "service_required" and two.lemon  # 2 < 3 failures
    assert two.failures_by_remedy == {"reset_gpu": 2}
    # outside the lemon window the earlier reset no longer counts
    (late,) = node_table(tmp_path, now=3 * H + 40 * 86400 - 1.5 * H)
    assert late.remedy == "reset_gpu" and not late.lemon


def test_drain_classes_do_not_escalate(tmp_path):
    for i, state in enumerate(["drained", "validated", "drained"]):
        record_state(
            "n2", state, "r", remedy="drain" if state == "drained" else None, fleet=tmp_path, t=i * H
        )
    (row,) = node_table(tmp_path, now=10 * H)
    assert row.remedy == "drain" and not row.lemon


# ------------------------------------------------------------------ acting, with the operator's flag
@pytest.fixture
def slurm(tmp_path, monkeypatch) -> Path:
    """Stand-in sinfo/scontrol on PATH; scontrol's arguments land in scontrol.args."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sinfo").write_text(
        "#!/bin/sh\nprintf 'n1|idle|none\\nn2|idle|none\\nn3|idle|none\\nn4|idle|none\\n'\n"
    )
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {bin_dir}/scontrol.args\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("GPUFLEET_FLEET_DIR", str(tmp_path / "fleet"))
    return bin_dir


def test_no_action_without_the_operators_flag(slurm, tmp_path):
    from gpufleet.backends.slurm.actions import SlurmActions

    rem = remediate(report("kern_xid79.log"), SlurmActions(), allow=frozenset({"drain", "reset_gpu"}))
    assert rem is not None and rem.action == "reboot" and rem.outcome == "not allowed"
    assert not (slurm / "scontrol.args").exists() and read_events(tmp_path / "fleet") == []
    assert remediate(report("kern_clean.log"), SlurmActions(), allow=frozenset(ACTABLE)) is None


def test_allowed_remedy_drains_with_an_owned_reason_and_is_audited(slurm, tmp_path):
    from gpufleet.backends.slurm.actions import SlurmActions

    rem = remediate(report("kern_xid79.log"), SlurmActions(), allow=parse_allow("reboot"))
    assert rem is not None and rem.outcome == "isolated" and rem.check == "gpu.xid"
    args = (slurm / "scontrol.args").read_text()
    assert args.startswith(
        "update nodename=n1 state=drain reason=gpufleet: gpu.xid: reboot: xid 79 on 0000:48:00"
    )
    evs = read_events(tmp_path / "fleet")
    action = [e for e in evs if e["ev"] == "node_action"]
    state = [e for e in evs if e["ev"] == "node_state"]
    assert [(a["action"], a["result"], a["platform"]) for a in action] == [("isolate", "done", "slurm")]
    assert [(s["state"], s["remedy"]) for s in state] == [("drained", "reboot")]


def test_parse_allow():
    assert parse_allow("all") == frozenset(ACTABLE) and "watch" not in ACTABLE
    assert parse_allow("drain, reboot") == {"drain", "reboot"}
    with pytest.raises(UsageError, match="unknown action class frob; valid: drain, reset_gpu"):
        parse_allow("drain,frob")
    with pytest.raises(UsageError):
        parse_allow("watch")

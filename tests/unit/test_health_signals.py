"""Link, fabric, memory, power, NIC, disk and DCGM signals of the health pillar, and the XID/SXID
classes. Fakes only at the process boundary: the fake NVML module with recordings, recorded kernel
logs, recorded sysfs trees, and recorded ``nvme``/``dcgmi`` output behind stand-in executables."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpufleet.health.fakes import FAKE_NVML_MODULE, data_path
from gpufleet.health.plans import parse_plan
from gpufleet.health.profiles import get_profile
from gpufleet.health.results import Status
from gpufleet.health.runner import run_plan
from gpufleet.health.xid import (
    ACTIONS,
    classify,
    classify_sxid,
    parse_sxids,
    worst_action,
    xid_table,
)


def run(check: str, env: dict[str, str], profile: str = "H100", **params: object) -> list:
    plan = parse_plan({"name": "t", "budget_s": 30, "checks": [{"name": check, "params": params}]}, "test")
    return run_plan(plan, get_profile(profile), node="n1", env=env).results


@pytest.fixture
def nvml(monkeypatch):
    """Point the fake NVML module at recordings (several: one per reading) and return the env."""

    def set_env(*recordings: str, kernel_log: str = "kern_clean.log") -> dict[str, str]:
        env = {
            "GPUFLEET_NVML_MODULE": FAKE_NVML_MODULE,
            "GPUFLEET_FAKE_NVML": ":".join(str(data_path(r)) for r in recordings),
            "GPUFLEET_KERNEL_LOG": str(data_path(kernel_log)),
        }
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        return env

    return set_env


# ------------------------------------------------------------------------------------ XID / SXID
def test_every_xid_in_the_table_has_a_class_a_reason_and_a_link():
    t = xid_table()
    codes = {int(c) for c in t["names"]}
    ruled = [c for r in t["rule"] for c in r["codes"]]
    assert len(ruled) == len(set(ruled)), "a code in two rules: only the first would count"
    assert codes == set(ruled), f"named but unclassified: {codes - set(ruled)}; unnamed: {set(ruled) - codes}"
    assert set(range(1, 126)) <= codes  # the documented codes 1-125, unused ones included
    for code in codes:
        c = classify(code)
        assert c.action in ACTIONS and c.severity in ("fatal", "warn", "app"), code
        assert c.reason and c.name and c.url.startswith("https://docs.nvidia.com/deploy/xid-errors/"), code
    for rule in t["sxid"]["rule"]:
        for code in rule["codes"]:
            c = classify_sxid(code)
            assert c.action in ACTIONS and c.reason and "fabric-manager" in c.url, code


def test_xid_classes_map_to_actions():
    assert classify(79).action == "reboot" and classify(79).severity == "fatal"
    assert classify(48).action == "reset_gpu" and classify(64).action == "service_required"
    assert classify(63).action == "reset_gpu" and classify(63).severity == "warn"  # remap pending
    assert classify(13).action == "watch" and classify(13).severity == "app"
    unknown = classify(9999)
    assert unknown.action == "watch" and "unclassified" in unknown.reason and unknown.url
    assert worst_action(["watch", "reboot", "reset_gpu"]) == "reboot" and worst_action([]) == "watch"


def test_sxid_lines_are_parsed_and_classified_by_code_or_by_their_severity_word():
    evs = parse_sxids(data_path("kern_sxid.log").read_text())
    # the "Severity N Engine instance" continuation lines are not events of their own
    assert [(e.switch, e.code, e.fatal) for e in evs] == [
        ("nvidia-nvswitch2", 12028, False),
        ("nvidia-nvswitch3", 20034, True),
    ]
    assert evs[1].pci == "0000:08:00.0" and evs[1].text == "Link 30 LTSSM Fault Up"
    assert classify_sxid(20034, True).action == "reboot"
    assert classify_sxid(12028, False).action == "watch"
    assert classify_sxid(99999, False).severity == "warn" and classify_sxid(99999, True).severity == "fatal"


def test_sxid_check(nvml):
    (r,) = run("gpu.sxid", nvml("nvml_h100_ok.json", kernel_log="kern_sxid.log"))
    assert r.status is Status.FAIL and "sxid 20034 on nvidia-nvswitch3" in r.detail and r.value == 1
    assert r.data["action"] == "reboot" and r.hint.startswith("reboot:") and "fabric-manager" in r.hint
    (w,) = run("gpu.sxid", nvml("nvml_h100_ok.json", kernel_log="kern_sxid_nonfatal.log"))
    assert w.status is Status.WARN and w.data["action"] == "watch" and w.hint
    (ok,) = run("gpu.sxid", nvml("nvml_h100_ok.json", kernel_log="kern_xid79.log"))
    assert ok.status is Status.OK and ok.detail == "no SXIDs"


def test_xid_check_carries_the_action_and_the_link(nvml):
    (r,) = run("gpu.xid", nvml("nvml_h100_ok.json", kernel_log="kern_sxid.log"))
    assert r.status is Status.FAIL and r.data["action"] == "reset_gpu"  # xid 74 (NVLink)
    assert r.data["classes"]["74"]["url"].startswith("https://docs.nvidia.com/deploy/xid-errors/")
    assert r.hint.startswith("reset_gpu:")

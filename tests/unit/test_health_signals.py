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


# ------------------------------------------------------------------------------------ NVLink
def statuses(results) -> dict[str, Status]:
    return {r.device: r.status for r in results}


def test_nvlink_healthy(nvml):
    res = run("nvlink.state", nvml("nvml_h100_links_ok.json"))
    assert statuses(res) == {"gpu0": Status.OK, "gpu1": Status.OK}
    assert "18/18 links up at 26.6 GB/s" in res[0].detail


def test_nvlink_down_links_fail_with_their_numbers(nvml):
    res = run("nvlink.state", nvml("nvml_h100_nvlink_down.json"))
    assert statuses(res) == {"gpu0": Status.OK, "gpu1": Status.FAIL}
    bad = res[1]
    assert "link(s) 5, 11 down" in bad.detail and "active NVLinks 16 links (limit 18)" in bad.detail
    assert bad.hint
    # A100 expects 12 links: the same 16 active links pass the count there, the down links still fail
    a100 = run("nvlink.state", nvml("nvml_h100_nvlink_down.json"), profile="A100")
    assert a100[1].status is Status.FAIL and "active NVLinks" not in a100[1].detail


def test_nvlink_speed_below_the_platform(nvml):
    res = run("nvlink.state", nvml("nvml_h100_nvlink_slow.json"))
    assert res[1].status is Status.FAIL and "NVLink speed 13.281 GB/s (limit 24)" in res[1].detail


def test_nvlink_error_counts_and_rates(nvml):
    res = run("nvlink.state", nvml("nvml_h100_nvlink_crc.json"))
    assert res[1].status is Status.FAIL
    assert "link 3 crc errors 25000 count (limit 10000)" in res[1].detail
    assert "link 7 recovery errors 2 count (limit 0)" in res[1].detail  # a WARN, listed too
    # two readings 0.05 s apart: 40 new CRC errors is far above 100/min
    rate = run(
        "nvlink.state", nvml("nvml_h100_links_ok.json", "nvml_h100_nvlink_crc_later.json"), window_s=0.05
    )
    assert rate[1].status is Status.FAIL and "link 3 crc/min" in rate[1].detail
    assert rate[0].status is Status.OK and "rates over" in rate[0].detail


# -------------------------------------------------------------------------------------- PCIe
def test_pcie_healthy_and_downgraded(nvml):
    assert statuses(run("pcie.link", nvml("nvml_h100_links_ok.json"))) == {
        "gpu0": Status.OK,
        "gpu1": Status.OK,
    }
    res = run("pcie.link", nvml("nvml_h100_pcie_bad.json"))
    bad = res[1]
    assert bad.status is Status.FAIL and bad.hint
    for needle in (
        "PCIe replays 500 count (limit 100)",
        "PCIe link x8 of x16",
        "PCIe gen4 of gen5 while busy",
    ):
        assert needle in bad.detail


def test_pcie_gen_is_not_judged_on_an_idle_gpu(nvml):
    res = run("pcie.link", nvml("nvml_h100_pcie_idle.json"))
    assert res[1].status is Status.OK and "gen1/5" in res[1].detail


def test_pcie_replay_rate(nvml):
    res = run(
        "pcie.link", nvml("nvml_h100_links_ok.json", "nvml_h100_pcie_replays_later.json"), window_s=0.05
    )
    assert res[1].status is Status.FAIL and "PCIe replays/min" in res[1].detail


# -------------------------------------------------------------------------- ECC, throttle, power
def test_ecc_corrected_counts_and_retired_pages(nvml):
    ok = run("gpu.ecc", nvml("nvml_h100_links_ok.json"))
    assert statuses(ok) == {"gpu0": Status.OK, "gpu1": Status.OK} and "3 corrected ECC" in ok[0].detail
    bad = run("gpu.ecc", nvml("nvml_h100_ecc_bad.json"))[1]
    assert bad.status is Status.FAIL and bad.component == "memory" and bad.hint
    for needle in ("volatile corrected ECC 20000", "retired pages 72 pages (limit 59)", "retirement pending"):
        assert needle in bad.detail


def test_double_bit_ecc_and_remap_failure_stay_gpu_state_signals(nvml):
    (bad,) = [r for r in run("gpu.state", nvml("nvml_h100_bad_gpu3.json")) if r.device == "gpu3"]
    assert "volatile uncorrected ECC 2" in bad.detail and "row remapping failed" in bad.detail


def test_throttle_time_per_reason(nvml):
    ok = run("gpu.throttle", nvml("nvml_h100_links_ok.json", "nvml_h100_links_ok_later.json"), window_s=0.01)
    assert statuses(ok) == {"gpu0": Status.OK, "gpu1": Status.OK} and "thermal 0.0%" in ok[0].detail
    res = run("gpu.throttle", nvml("nvml_h100_links_ok.json", "nvml_h100_throttle_later.json"), window_s=0.01)
    assert res[1].status is Status.FAIL and "throttled by thermal 20 % (limit 10)" in res[1].detail
    assert res[0].status is Status.WARN and "throttled by power 60 % (limit 50)" in res[0].detail
    assert res[1].hint


def test_throttle_without_a_window_is_incomplete(nvml):
    (r,) = run("gpu.throttle", nvml("nvml_h100_links_ok.json"), window_s=0)
    assert r.status is Status.INCOMPLETE and r.hint


def test_power_draw_against_the_limit(nvml):
    ok = run("gpu.power", nvml("nvml_h100_links_ok.json"))
    assert statuses(ok) == {"gpu0": Status.OK, "gpu1": Status.OK} and "612 W of 700 W" in ok[0].detail
    over = run("gpu.power", nvml("nvml_h100_power_over.json"))[1]
    assert over.status is Status.FAIL and "power draw, % of the limit, 111.4 %" in over.detail and over.hint
    capped = run("gpu.power", nvml("nvml_h100_power_capped.json"))[1]
    assert capped.status is Status.WARN and "enforced power limit 450 W (limit 700)" in capped.detail


def test_old_recordings_without_the_new_readings(nvml):
    """A driver that reads none of the new counters: INCOMPLETE, never OK."""
    env = nvml("nvml_h100_ok.json")
    for check in ("nvlink.state", "pcie.link", "gpu.ecc", "gpu.power"):
        (r,) = run(check, env)
        assert r.status is Status.INCOMPLETE, (check, r.detail)


# ------------------------------------------------------------------------- InfiniBand / RoCE
def ib(tree: str, profile: str = "H100", **params: object) -> list:
    return run("net.ib", {"GPUFLEET_SYSFS_ROOT": str(data_path(f"sysfs/{tree}"))}, profile, **params)


def test_ib_healthy():
    res = ib("ib_ok", expect_ports=3)
    assert [r.status for r in res] == [Status.OK] * 3
    assert [r.device for r in res] == ["mlx5_0/1", "mlx5_1/1", "mlx5_2/1"]
    assert res[2].detail.startswith("Ethernet ACTIVE, 400 Gb/sec") and res[0].value == 400
    assert res[0].component == "network"


def test_ib_port_down_low_rate_and_flaps():
    down = {r.device: r for r in ib("ib_port_down")}["mlx5_1/1"]
    assert down.status is Status.FAIL and "DOWN / Disabled" in down.detail and down.hint
    slow = {r.device: r for r in ib("ib_low_rate")}["mlx5_1/1"]
    assert slow.status is Status.FAIL and "rate 200 Gb/s (limit 400)" in slow.detail
    assert {r.device: r.status for r in ib("ib_low_rate", profile="A100")}["mlx5_1/1"] is Status.OK
    flap = {r.device: r for r in ib("ib_flapping")}["mlx5_1/1"]
    assert flap.status is Status.FAIL and "link went down 7 count (limit 3)" in flap.detail
    assert "link error recoveries 15" in flap.detail


def test_ib_missing_ports(tmp_path):
    (none,) = run("net.ib", {"GPUFLEET_SYSFS_ROOT": str(tmp_path)})
    assert none.status is Status.OK and "set expect_ports" in none.detail
    (req,) = run("net.ib", {"GPUFLEET_SYSFS_ROOT": str(tmp_path)}, expect_ports=4)
    assert req.status is Status.FAIL and req.hint
    res = ib("ib_ok", expect_ports=4)
    assert res[-1].status is Status.FAIL and "3 ports, expected 4" in res[-1].detail


# ------------------------------------------------------------------------ NVMe SMART, DCGM diag
def stand_in(tmp_path: Path, name: str, recording: str, rc: int = 0) -> dict[str, str]:
    """An executable ``name`` on a PATH of its own that prints a recording and logs its arguments."""
    exe = tmp_path / name
    exe.write_text(
        f'#!/bin/sh\necho "$@" >> {tmp_path}/{name}.args\n/bin/cat {data_path(recording)}\nexit {rc}\n'
    )
    exe.chmod(0o755)
    return {"PATH": str(tmp_path), "GPUFLEET_SYSFS_ROOT": str(data_path("sysfs/ib_ok"))}


def test_nvme_smart(tmp_path):
    (ok,) = run("storage.nvme", stand_in(tmp_path, "nvme", "nvme_smart_ok.json"))
    assert ok.status is Status.OK and ok.device == "/dev/nvme0" and "3% used" in ok.detail
    assert (tmp_path / "nvme.args").read_text().strip() == "smart-log /dev/nvme0 -o json"
    (worn,) = run("storage.nvme", stand_in(tmp_path, "nvme", "nvme_smart_worn.json"))
    assert worn.status is Status.WARN and "wear 87 %" in worn.detail and "media errors 2" in worn.detail
    (bad,) = run("storage.nvme", stand_in(tmp_path, "nvme", "nvme_smart_failing.json"))
    assert bad.status is Status.FAIL and bad.hint
    for needle in ("available spare below threshold", "reliability degraded", "wear 104 %"):
        assert needle in bad.detail


def test_nvme_without_the_tool_or_the_drives(tmp_path):
    (r,) = run("storage.nvme", {"PATH": str(tmp_path), "GPUFLEET_SYSFS_ROOT": str(data_path("sysfs/ib_ok"))})
    assert (
        r.status is Status.INCOMPLETE and "nvme command is not installed" in r.detail and "nvme-cli" in r.hint
    )
    plan = parse_plan({"name": "t", "budget_s": 30, "checks": [{"name": "storage.nvme"}]}, "test")
    rep = run_plan(plan, get_profile("CPU"), node="n1", env={"GPUFLEET_SYSFS_ROOT": str(tmp_path)})
    assert rep.results == [] and rep.not_applicable == [
        f"storage.nvme (no NVMe controllers under {tmp_path}/class/nvme)"
    ]


def test_dcgm_diag_levels(tmp_path):
    (ok,) = run("dcgm.diag_r1", stand_in(tmp_path, "dcgmi", "dcgmi_diag_r1_pass.json"))
    assert ok.status is Status.OK and "8 test results passed (1 skipped)" in ok.detail
    assert (tmp_path / "dcgmi.args").read_text().strip() == "diag -r 1 -j"
    (bad,) = run("dcgm.diag_r2", stand_in(tmp_path, "dcgmi", "dcgmi_diag_r2_fail.json", rc=226))
    assert bad.status is Status.FAIL and bad.value == 1 and bad.hint
    assert "PCIe gpu1 FAIL: GPU 1 host-to-device bandwidth 9.84 GB/s" in bad.detail
    assert "Diagnostic gpu0 WARN: GPU 0 clocks throttled" in bad.detail


def test_dcgm_absent_is_not_applicable_and_a_dead_host_engine_is_incomplete(tmp_path):
    plan = parse_plan({"name": "t", "budget_s": 30, "checks": [{"name": "dcgm.diag_r1"}]}, "test")
    rep = run_plan(plan, get_profile("H100"), node="n1", env={"PATH": str(tmp_path)})
    assert rep.results == [] and rep.not_applicable == [
        "dcgm.diag_r1 (dcgmi not found: DCGM is not installed)"
    ]
    (r,) = run("dcgm.diag_r1", stand_in(tmp_path, "dcgmi", "kern_clean.log", rc=1))
    assert r.status is Status.INCOMPLETE and "nvidia-dcgm" in r.hint


def test_acceptance_plan_runs_dcgm_levels():
    from gpufleet.health.plans import load_plan

    names = [c.name for c in load_plan("acceptance").checks]
    assert {"dcgm.diag_r1", "dcgm.diag_r2", "nvlink.state", "pcie.link", "net.ib", "gpu.sxid"} <= set(names)


# ------------------------------------------------------------- driver and firmware agreement
def test_versions_check_reads_the_node_inventory(nvml, monkeypatch):
    env = nvml("nvml_h100_links_ok.json")
    env["GPUFLEET_SYSFS_ROOT"] = str(data_path("sysfs/ib_ok"))
    (r,) = run("gpu.versions", env)
    assert r.status is Status.OK
    assert r.data["inventory"] == {"driver": "550.54.15", "vbios": "96.00.74.00.1A", "hca_fw": "28.39.2048"}


def test_odd_node_of_a_job_is_flagged(nvml):
    from gpufleet.health.agreement import apply_agreement, odd_nodes

    plan = parse_plan({"name": "t", "budget_s": 30, "checks": [{"name": "gpu.versions"}]}, "test")
    reports = []
    for node, rec in (
        ("n1", "nvml_h100_links_ok.json"),
        ("n2", "nvml_h100_old_driver.json"),
        ("n3", "nvml_h100_links_ok.json"),
    ):
        reports.append(run_plan(plan, get_profile("H100"), node=node, env=nvml(rec)))
    found = apply_agreement(reports)
    assert set(found) == {"n2"}
    assert "driver 535.161.08 (most nodes: 550.54.15, 2 of 3)" in found["n2"]
    assert any(p.startswith("vbios 96.00.61.00.01") for p in found["n2"])
    odd = reports[1].results[-1]
    assert odd.status is Status.FAIL and odd.device == "job" and odd.hint and reports[1].exit_code() == 1
    assert [r.status for r in reports[0].results] == [Status.OK]  # the others are left as they were
    # firmware only: WARN; no majority: every node is named
    assert odd_nodes({"a": {"vbios": "1"}, "b": {"vbios": "1"}, "c": {"vbios": "2"}}) == {
        "c": ["vbios 2 (most nodes: 1, 2 of 3)"]
    }
    split = odd_nodes({"a": {"driver": "1"}, "b": {"driver": "2"}})
    assert set(split) == {"a", "b"} and "no majority" in split["a"][0]
    assert odd_nodes({"a": {"driver": "1"}, "b": {"driver": "1"}}) == {}


def test_the_ray_sweep_compares_its_nodes_and_carries_the_remedy(nvml):
    from gpufleet.backends.ray.quarantine import NodeHealth, _agree, _remedy

    plan = parse_plan(
        {"name": "t", "budget_s": 30, "checks": [{"name": "gpu.versions"}, {"name": "gpu.xid"}]}, "t"
    )
    swept = []
    for node, rec, log in (
        ("a", "nvml_h100_links_ok.json", "kern_clean.log"),
        ("b", "nvml_h100_old_driver.json", "kern_clean.log"),
        ("c", "nvml_h100_links_ok.json", "kern_xid79.log"),
    ):
        rep = run_plan(plan, get_profile("H100"), node=node, env=nvml(rec, kernel_log=log))
        swept.append(NodeHealth(node, node, rep.exit_code(), rep.to_dict()))
    _agree(swept)
    assert [(h.node, h.exit_code, h.report["status"]) for h in swept] == [
        ("a", 0, "OK"),
        ("b", 1, "FAIL"),  # the odd driver: its report and exit code now say so
        ("c", 1, "FAIL"),  # xid 79
    ]
    assert [_remedy(h) for h in swept] == [None, None, "reboot"]

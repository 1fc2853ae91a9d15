"""Pure pieces of the health pillar: thresholds, outlier math, busbw, pairwise search, XIDs, clocks, plans."""

from __future__ import annotations

import pytest

from gpufleet.core.errors import UsageError
from gpufleet.health.checks.collective import busbw
from gpufleet.health.checks.host import parse_clock_offset
from gpufleet.health.fakes import data_path
from gpufleet.health.pairwise import find_bad_nodes
from gpufleet.health.plans import TIERS, load_plan
from gpufleet.health.profiles import Threshold, detect_profile, get_profile, load_profiles
from gpufleet.health.relative import MAD_SCALE, fleet_outlier, mad, node_outliers
from gpufleet.health.results import CheckResult, Report, Status
from gpufleet.health.xid import classify, parse_xids, repeat_suspects


def test_threshold_judge():
    th = Threshold(unit="GB/s", fail_below=10, warn_below=20)
    assert th.judge(5) == (Status.FAIL, 10)
    assert th.judge(15) == (Status.WARN, 20)
    assert th.judge(25)[0] is Status.OK
    assert th.scale(3e9) == 3.0
    up = Threshold(unit="ms", warn_above=50, fail_above=1000)
    assert up.judge(2000)[0] is Status.FAIL and up.judge(60)[0] is Status.WARN and up.judge(1)[0] is Status.OK


def test_node_outliers_within_tolerance_of_best():
    assert node_outliers({"g0": 100, "g1": 95, "g2": 85}, tol=0.10) == {"g2": pytest.approx(0.15)}
    assert node_outliers({"g0": 100}) == {}


def test_fleet_outlier_mad_rule():
    peers = [100, 101, 99, 100, 102, 98, 100]
    assert mad(peers) == 1
    bad, cut = fleet_outlier(90, peers, k=3, min_drop=0.05)
    assert bad and cut == pytest.approx(min(100 - 3 * MAD_SCALE, 95))
    assert not fleet_outlier(97, peers, k=3, min_drop=0.05)[0]  # within k MADs... and min_drop
    assert fleet_outlier(90, [100, 100], min_peers=3) == (False, None)  # too few peers
    # Zero spread: the min_drop floor keeps 1% noise from failing a node.
    assert not fleet_outlier(99, [100, 100, 100, 100], k=3, min_drop=0.05)[0]


def test_busbw_is_the_nccl_tests_definition():
    assert busbw(1e9, 1.0, 2) == pytest.approx(1e9)  # 2(n-1)/n = 1
    assert busbw(1e9, 1.0, 8) == pytest.approx(1e9 * 14 / 8)
    with pytest.raises(ValueError):
        busbw(1, 0, 2)


def test_pairwise_finds_the_bad_node():
    bad_nodes = {"n4"}
    calls = []

    def measure(a, b):
        calls.append((a, b))
        return 10.0 if {a, b} & bad_nodes else 100.0

    res = find_bad_nodes([f"n{i}" for i in range(8)], measure, floor=50)
    assert res.bad == ["n4"] and "n5" in res.cleared and not res.inconclusive
    assert len(calls) == 4 + 2  # pass 1: 4 pairs; pass 2: the two suspects


def test_pairwise_odd_count_timeout_and_all_bad():
    def measure(a, b):
        if "n2" in (a, b):
            raise TimeoutError
        return 100.0

    res = find_bad_nodes(["n0", "n1", "n2"], measure, floor=50)
    assert res.bad == ["n2"] and res.cleared == ["n0", "n1"]
    res = find_bad_nodes(["a", "b"], lambda a, b: 1.0, floor=50)
    assert res.inconclusive == ["a", "b"] and not res.bad


def test_xid_parse_and_classify():
    evs = parse_xids(data_path("kern_xid79.log").read_text())
    assert [(e.pci, e.code) for e in evs] == [("0000:48:00", 13), ("0000:58:00", 13), ("0000:48:00", 79)]
    assert classify(79).severity == "fatal" and classify(79).action == "reboot"
    assert classify(13).severity == "app" and classify(68).severity == "warn"
    assert classify(9999).severity == "warn"
    many = parse_xids(data_path("kern_app13.log").read_text())
    assert repeat_suspects(many) == []  # spread over GPUs: an application bug
    one = parse_xids("\n".join(["NVRM: Xid (PCI:0000:18:00): 13, pid=1, x"] * 3))
    assert repeat_suspects(one) == ["0000:18:00"]


def test_clock_offset_parsing():
    assert parse_clock_offset(data_path("chrony_tracking.txt").read_text()) == pytest.approx(0.000183112)
    assert parse_clock_offset("offset 12.5 ms") == pytest.approx(0.0125)
    assert parse_clock_offset("nothing here") is None


def test_report_exit_codes_and_schema():
    def rep(*st):
        return Report("n", "quick", "CPU", 0.0, 1.0, [CheckResult("c", s) for s in st], valid_until=10.0)

    assert rep(Status.OK, Status.WARN).exit_code() == 0
    assert rep(Status.OK, Status.INCOMPLETE).exit_code() == 3
    assert rep(Status.FAIL, Status.INCOMPLETE).exit_code() == 1
    d = rep(Status.OK, Status.FAIL).to_dict()
    assert d["schema"] == "gpufleet.health/1" and d["status"] == "FAIL" and d["counts"]["FAIL"] == 1


def test_profiles_and_detection():
    ps = load_profiles()
    assert set(ps) == {"CPU", "H100", "H200", "GB200", "B200", "A100"}
    assert detect_profile(["NVIDIA GB200"]).name == "GB200"  # not B200, whose name it contains
    assert ps["H200"].threshold("compute.matmul").unit == "TFLOPS"
    assert ps["H200"].threshold("storage.write") is not None  # merged from [defaults]
    assert detect_profile(["NVIDIA H200"]).name == "H200" and detect_profile([]).name == "CPU"
    assert get_profile("h100").name == "H100"
    with pytest.raises(UsageError, match="valid: CPU, H100"):
        get_profile("V100")
    with pytest.raises(UsageError, match="no profile matches"):
        detect_profile(["Tesla T4"])


@pytest.mark.parametrize("tier", TIERS)
def test_builtin_plans_validate(tier):
    plan = load_plan(tier)
    assert plan.name == tier and plan.checks


@pytest.mark.parametrize(
    "text, match",
    [
        (
            "name = 'x'\nbudget_s = 5\n[[checks]]\nname = 'gpu.frob'\n",
            r"unknown check 'gpu.frob'; valid: .*host.clock",
        ),
        ("name = 'x'\n[[checks]]\nname = 'host.mounts'\n", "budget_s"),
        ("name = 'x'\nbudget_s = 5\nchecks = []\n", "checks"),
        ("name = 'x'\nbudget_s = 5\nbogus = 1\n[[checks]]\nname = 'host.mounts'\n", "bogus"),
        ("name = [broken\n", "malformed plan file"),
    ],
)
def test_bad_plan_files_are_one_line_usage_errors(tmp_path, text, match):
    p = tmp_path / "plan.toml"
    p.write_text(text)
    with pytest.raises(UsageError, match=match) as ei:
        load_plan(str(p))
    assert "\n" not in str(ei.value)


def test_unknown_plan_name_lists_tiers():
    with pytest.raises(UsageError, match="valid: quick, postfail, acceptance"):
        load_plan("deep")

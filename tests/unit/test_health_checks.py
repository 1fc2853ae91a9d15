"""Checks through the runner, with a fake NVML module and recorded kernel logs at the process boundary."""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from gpufleet.health.checks import register
from gpufleet.health.fakes import FAKE_NVML_MODULE, data_path
from gpufleet.health.plans import parse_plan
from gpufleet.health.profiles import get_profile
from gpufleet.health.results import CheckResult, Status
from gpufleet.health.runner import apply_fleet_rule, fleet_peers, load_fleet_events, record_report, run_plan


def plan(*checks: dict, budget: float = 30) -> object:
    return parse_plan({"name": "t", "budget_s": budget, "checks": list(checks)}, "test")


def fake_env(recording: str, kernel_log: str = "kern_clean.log") -> dict[str, str]:
    return {
        "GPUFLEET_NVML_MODULE": FAKE_NVML_MODULE,
        "GPUFLEET_FAKE_NVML": str(data_path(recording)),
        "GPUFLEET_KERNEL_LOG": str(data_path(kernel_log)),
    }


@pytest.fixture
def nvml_env(monkeypatch):
    def set_env(recording: str, kernel_log: str = "kern_clean.log") -> dict[str, str]:
        env = fake_env(recording, kernel_log)
        for k, v in env.items():
            monkeypatch.setenv(k, v)  # read_gpus reads os.environ (the import boundary)
        return env

    return set_env


GPU_PLAN = ({"name": "gpu.inventory"}, {"name": "gpu.state"}, {"name": "gpu.xid"})


def by_check(report):
    out: dict[str, list] = {}
    for r in report.results:
        out.setdefault(r.check, []).append(r)
    return out


def test_healthy_h100_node(nvml_env):
    env = nvml_env("nvml_h100_ok.json")
    rep = run_plan(plan(*GPU_PLAN), get_profile("H100"), node="n1", env=env)
    assert [r.status for r in rep.results] == [Status.OK] * 10, [r.detail for r in rep.results]
    assert rep.exit_code() == 0


def test_bad_gpu_is_named_with_its_problems(nvml_env):
    env = nvml_env("nvml_h100_bad_gpu3.json", "kern_xid79.log")
    rep = run_plan(plan(*GPU_PLAN), get_profile("H100"), node="n1", env=env)
    res = by_check(rep)
    bad = [r for r in res["gpu.state"] if r.status is not Status.OK]
    assert [r.device for r in bad] == ["gpu3"] and bad[0].status is Status.FAIL
    for needle in (
        "volatile uncorrected ECC 2",
        "row remapping failed",
        "hw_slowdown",
        "temperature",
        "width 8",
    ):
        assert needle in bad[0].detail
    assert bad[0].hint
    (x,) = res["gpu.xid"]
    assert x.status is Status.FAIL and "xid 79 on 0000:48:00" in x.detail and x.value == 1
    assert rep.exit_code() == 1


def test_missing_gpu_and_driver_not_loaded(nvml_env):
    env = nvml_env("nvml_h100_seven.json")
    (r,) = run_plan(plan({"name": "gpu.inventory"}), get_profile("H100"), env=env).results
    assert r.status is Status.FAIL and (r.value, r.threshold) == (7, 8)
    env = nvml_env("nvml_no_driver.json")
    (r,) = run_plan(plan({"name": "gpu.inventory"}), get_profile("H100"), env=env).results
    assert r.status is Status.FAIL and "Driver Not Loaded" in r.detail


def test_unreadable_ecc_is_reported_and_expect_gpus(nvml_env):
    env = nvml_env("nvml_h200_one.json")
    rep = run_plan(plan(*GPU_PLAN[:2]), get_profile("H200"), env=env, expect_gpus=1)
    assert [r.status for r in rep.results] == [Status.OK, Status.OK]
    assert "not readable: ecc_aggregate, ecc_volatile" in rep.results[1].detail


def test_nvml_not_installed(monkeypatch):
    monkeypatch.setenv("GPUFLEET_NVML_MODULE", "gpufleet_no_such_nvml")
    (r,) = run_plan(plan({"name": "gpu.inventory"}), get_profile("H100")).results
    assert r.status is Status.INCOMPLETE and "gpu]" in r.detail
    (r,) = run_plan(plan({"name": "gpu.inventory"}), get_profile("CPU")).results
    assert r.status is Status.OK


def test_gpu_checks_not_applicable_on_cpu_and_kernel_log_unreadable(tmp_path):
    rep = run_plan(plan(*GPU_PLAN), get_profile("CPU"))
    assert rep.not_applicable == ["gpu.state", "gpu.xid"]
    env = fake_env("nvml_h100_ok.json")
    env["GPUFLEET_KERNEL_LOG"] = str(tmp_path / "missing.log")
    (r,) = run_plan(plan({"name": "gpu.xid"}), get_profile("H100"), env=env).results
    assert r.status is Status.INCOMPLETE


@register("test.crash", component="host", timeout_s=5)
def _crash(ctx):
    raise RuntimeError("boom")


@register("test.hang", component="host", timeout_s=5)
def _hang(ctx):
    time.sleep(3)
    return []


def test_crash_timeout_and_budget_are_incomplete_and_the_plan_goes_on():
    rep = run_plan(
        plan({"name": "test.crash"}, {"name": "test.hang", "timeout_s": 0.3}, {"name": "host.mounts"}),
        get_profile("CPU"),
    )
    crash, hang, mounts = rep.results
    assert crash.status is Status.INCOMPLETE and "RuntimeError: boom" in crash.detail
    assert hang.status is Status.INCOMPLETE and "timed out" in hang.detail
    assert mounts.status is Status.OK
    assert rep.exit_code() == 3
    rep = run_plan(
        plan({"name": "test.hang", "timeout_s": 2}, {"name": "host.mounts"}, budget=0.5), get_profile("CPU")
    )
    assert [r.status for r in rep.results] == [Status.INCOMPLETE, Status.INCOMPLETE]
    assert "budget" in rep.results[1].detail


def test_host_and_storage_on_cpu(tmp_path):
    env = {"GPUFLEET_CLOCK_FILE": str(data_path("chrony_tracking.txt"))}
    rep = run_plan(
        plan(
            {"name": "host.resources"},
            {"name": "host.mounts", "params": {"mounts": ["/", "/no/such"]}},
            {"name": "host.clock"},
            {"name": "storage.throughput", "params": {"mb": 4, "paths": [str(tmp_path)]}},
            {"name": "storage.checkpoint", "params": {"files": 3, "file_mb": 2, "paths": [str(tmp_path)]}},
        ),
        get_profile("CPU"),
        env=env,
    )
    res = by_check(rep)
    assert res["host.mounts"][0].status is Status.FAIL and "/no/such" in res["host.mounts"][0].detail
    assert res["host.clock"][0].value == pytest.approx(0.183112, rel=1e-3)  # ms
    assert {r.device.rsplit(":", 1)[1] for r in res["storage.throughput"]} == {"write", "read", "fsync_p99"}
    assert all(r.value and r.value > 0 for r in res["storage.throughput"] + res["storage.checkpoint"])
    assert list(Path(tmp_path).iterdir()) == []  # cleaned up
    (bad,) = run_plan(
        plan({"name": "storage.throughput", "params": {"paths": [str(tmp_path / "nope")]}}),
        get_profile("CPU"),
    ).results
    assert bad.status is Status.FAIL


def test_clock_without_reference_is_incomplete():
    (r,) = run_plan(
        plan({"name": "host.clock", "params": {"clock_command": "no-such-chronyc tracking"}}),
        get_profile("CPU"),
    ).results
    assert r.status is Status.INCOMPLETE


MATMUL = {"name": "compute.matmul", "params": {"samples": 40, "cpu_devices": 2}}


class VirtualClock:
    """Stands in for the ``time`` module of ``measure``: time moves only when the test says so.

    ``perf_counter`` advances by a 1 us tick per call, so ``stretch``'s spin-wait ends; ``sleep`` advances
    by its argument. With a stub matmul that takes exactly 1 ms of this clock, the measured times depend on
    the code under test alone, not on how busy the machine is (a pinned sample on a busy core of a shared
    CI box can take several times longer than one on an idle core, real slowdown injection or not).
    """

    TICK = 1e-6

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        t = self.now
        self.now += self.TICK
        return t

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.now += seconds


MATMUL_S = 1e-3  # virtual seconds one stub torch.mm takes


@pytest.fixture
def virtual_matmul(monkeypatch):
    """Run compute.matmul's CPU path (pinning, injection, min of samples, peer rule) on a virtual clock.

    Returns the names of the two CPU lanes the check measures on this machine and the stub's calls."""
    import torch

    from gpufleet.health.checks import compute, measure

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPU cores: the check measures one lane per core")
    clock = VirtualClock()
    monkeypatch.setattr(measure, "time", clock)
    calls = []

    def mm(a, b):
        calls.append((a.shape, b.shape))
        clock.now += MATMUL_S

    monkeypatch.setattr(torch, "mm", mm)
    params = MATMUL["params"]
    lanes = compute.cpu_lanes(SimpleNamespace(param=lambda k, d=None: params.get(k, d)))
    return [f"cpu{c}" for c in lanes], calls


def ran_on_the_stub(calls: list) -> bool:
    """Warm-up plus one stub call per lane and sample: the check really measured through the stub."""
    return len(calls) == 1 + 2 * MATMUL["params"]["samples"] and calls[0] == ((256, 256), (256, 256))


def test_relative_check_catches_an_injected_slow_device(virtual_matmul):
    (fast, slow), calls = virtual_matmul
    env = {"GPUFLEET_HEALTH_INJECT_SLOW": f"compute.matmul:{slow}=0.5"}
    rep = run_plan(plan(MATMUL), get_profile("CPU"), env=env)
    assert ran_on_the_stub(calls), [r.detail for r in rep.results]
    by_dev = {r.device: r for r in rep.results}
    assert set(by_dev) == {fast, slow}
    assert by_dev[slow].status is Status.FAIL and "below the best device" in by_dev[slow].detail
    assert by_dev[slow].detail.startswith("50% below")
    assert by_dev[fast].status is Status.OK and by_dev[fast].detail == "ok"


def test_peer_rule_can_be_turned_off_per_check(virtual_matmul):
    (fast, slow), calls = virtual_matmul
    env = {"GPUFLEET_HEALTH_INJECT_SLOW": f"compute.matmul:{slow}=0.5"}
    calm = {"name": "compute.matmul", "params": {**MATMUL["params"], "peer_rule": False}}
    rep = run_plan(plan(calm), get_profile("CPU"), env=env)
    assert ran_on_the_stub(calls), [r.detail for r in rep.results]
    by_dev = {r.device: r for r in rep.results}
    flops = 2.0 * 256**3 / MATMUL_S / 1e9  # GFLOPS of one 1 ms fp32 256x256 matmul
    assert by_dev[fast].value == pytest.approx(flops, rel=1e-2)
    assert by_dev[slow].value == pytest.approx(flops / 2, rel=1e-2)  # 0.5 injected: half the throughput
    assert by_dev[slow].status is Status.OK  # half speed, but far above the CPU floor of 1 GFLOPS
    assert "relative" not in by_dev[slow].data


def test_fleet_rule_and_recording(tmp_path):
    rep = run_plan(plan({"name": "host.resources"}), get_profile("CPU"), node="me")
    record_report(rep, tmp_path)
    evs = load_fleet_events(tmp_path)
    assert {e["ev"] for e in evs} == {"health_result"} and len(evs) == len(rep.results)
    assert all(e["valid_until"] > e["t"] and e["node"] == "me" for e in evs)
    cpus = next(r for r in rep.results if r.device == "cpus")
    mm = CheckResult("compute.matmul", Status.OK, 80.0, "GFLOPS", 1.0, device="cpu0")
    rep.results.append(mm)
    peers = {("host.resources", "cpus"): [cpus.value * 10] * 4, ("compute.matmul", "cpu0"): [100, 101, 99]}
    apply_fleet_rule(rep, get_profile("CPU"), peers)
    assert mm.status is Status.FAIL and "fleet peers" in mm.detail
    assert cpus.status is Status.OK  # counts have no fleet rule, only measured throughputs
    # Peers come from other nodes' valid results only.
    got = fleet_peers(evs, node="other", profile="CPU", now=time.time())
    assert got[("host.resources", "cpus")] == [cpus.value]
    assert fleet_peers(evs, node="me", profile="CPU", now=time.time()) == {}
    assert fleet_peers(evs, node="other", profile="CPU", now=time.time() + 10**6) == {}


HUNG_CHECK_PROGRAM = """
import threading
from gpufleet.health.checks import register
from gpufleet.health.plans import parse_plan
from gpufleet.health.profiles import get_profile
from gpufleet.health.runner import exit_past_hung_checks, run_plan

@register("test.stuck", component="host", timeout_s=5)
def _stuck(ctx):
    threading.Event().wait()  # never returns: the thread outlives the plan

plan = parse_plan({"name": "t", "budget_s": 5, "checks": [{"name": "test.stuck", "timeout_s": 0.2}]}, "test")
report = run_plan(plan, get_profile("CPU"))
print(report.results[0].status, flush=False)
exit_past_hung_checks(report.exit_code())
print("not reached")
"""


def test_a_hung_check_thread_does_not_hold_the_exit_and_the_code_and_output_survive():
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", HUNG_CHECK_PROGRAM], capture_output=True, text=True, timeout=60)
    assert p.returncode == 3, p.stderr[-2000:]
    assert p.stdout.split() == ["INCOMPLETE"], p.stdout

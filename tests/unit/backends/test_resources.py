"""Worker resource defaults (gpufleet.backends.resources): thread shares, cgroup quotas, NUMA nodes,
--cpu-affinity parsing and plans, and the user's own thread variables left alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpufleet.backends.resources import (
    THREAD_VARS,
    AffinityMode,
    CpuAffinity,
    DistPlan,
    cgroup_cpu_limit,
    dist_plan,
    format_cpulist,
    numa_nodes,
    parse_cpu_affinity,
    parse_cpulist,
    plan_ranks,
    thread_env,
    thread_note,
    visible_gpus,
)
from gpufleet.core.errors import ConfigError

NONE = CpuAffinity()


def cpus(text: str) -> frozenset[int]:
    return parse_cpulist(text)


@pytest.mark.parametrize(
    ("n", "host", "quota", "want"),
    [
        (2, "0-1", None, [1, 1]),  # the 2-CPU host: 1 each, as torchrun
        (1, "0-1", None, [2]),
        (3, "0-1", None, [1, 1, 1]),  # more ranks than CPUs: still at least 1
        (2, "0-15", None, [8, 8]),
        (3, "0-7", None, [2, 2, 2]),
        (2, "0-15", 4.0, [2, 2]),  # a cgroup quota caps the budget below the affinity mask
        (2, "0-15", 1.5, [1, 1]),  # a fractional quota rounds down (never above the quota)
        (1, "0-15", 0.5, [1]),
        (2, "2,5", None, [1, 1]),  # the affinity mask, not the machine, is what counts
    ],
)
def test_thread_share(n: int, host: str, quota: float | None, want: list[int]) -> None:
    plan = plan_ranks(n, NONE, cpus=cpus(host), quota=quota)
    assert [r.threads for r in plan] == want
    assert all(r.cpus is None for r in plan)  # none: no affinity set


def test_thread_env_sets_every_variable_the_user_did_not() -> None:
    assert thread_env(3, {}) == {v: "3" for v in THREAD_VARS}
    # the user chose MKL's: the rest are set, MKL's is left
    got = thread_env(1, {"MKL_NUM_THREADS": "4"})
    assert "MKL_NUM_THREADS" not in got and got["OMP_NUM_THREADS"] == "1"


def test_user_set_omp_num_threads_is_respected_and_nothing_said() -> None:
    env = {"OMP_NUM_THREADS": "6"}
    assert thread_env(1, env) == {}  # MKL/OpenBLAS fall back to OMP_NUM_THREADS themselves
    assert thread_note(plan_ranks(2, NONE, cpus=cpus("0-1")), env) is None
    note = thread_note(plan_ranks(2, NONE, cpus=cpus("0-1")), {"OMP_NUM_THREADS": ""})  # empty = unset
    assert note is not None and "OMP_NUM_THREADS=1" in note and "2 worker(s)" in note
    assert "\n" not in note


def test_cpulists_round_trip() -> None:
    assert parse_cpulist("0-3,8,10-11") == {0, 1, 2, 3, 8, 10, 11}
    assert format_cpulist({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11"
    assert parse_cpulist(" 5\n") == {5}
    for bad in ("a", "1-", "3-1", "1,,2"):
        with pytest.raises(ValueError):
            parse_cpulist(bad)


def test_cgroup_v2_quota_smallest_of_the_path_wins(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    (root / "a" / "b").mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu memory\n")
    (root / "a" / "cpu.max").write_text("150000 100000\n")  # 1.5 CPUs on the parent
    (root / "a" / "b" / "cpu.max").write_text("max 100000\n")  # none on the leaf
    proc = tmp_path / "cgroup"
    proc.write_text("0::/a/b\n")
    assert cgroup_cpu_limit(root, proc) == 1.5
    (root / "a" / "b" / "cpu.max").write_text("50000 100000\n")
    assert cgroup_cpu_limit(root, proc) == 0.5


def test_cgroup_v1_quota_and_no_quota(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    mount = root / "cpu,cpuacct" / "job"
    mount.mkdir(parents=True)
    (mount / "cpu.cfs_quota_us").write_text("300000\n")
    (mount / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/job\n3:cpu,cpuacct:/job\n0::/\n")
    assert cgroup_cpu_limit(root, proc) == 3.0
    (mount / "cpu.cfs_quota_us").write_text("-1\n")  # unlimited
    assert cgroup_cpu_limit(root, proc) is None
    assert cgroup_cpu_limit(root, tmp_path / "missing") is None


def test_numa_nodes_from_sysfs(tmp_path: Path) -> None:
    for n, cl in ((1, "4-7"), (0, "0-3"), (2, "")):  # node 2: memory only, no CPUs
        (tmp_path / f"node{n}").mkdir()
        (tmp_path / f"node{n}" / "cpulist").write_text(cl + "\n")
    (tmp_path / "possible").write_text("0-2\n")
    assert numa_nodes(tmp_path) == [cpus("0-3"), cpus("4-7")]
    assert numa_nodes(tmp_path / "absent") == []


def test_auto_affinity_gives_each_rank_its_own_block_inside_a_numa_node() -> None:
    nodes = [cpus("0-3"), cpus("4-7")]
    plan = plan_ranks(4, CpuAffinity(AffinityMode.AUTO), cpus=cpus("0-7"), nodes=nodes)
    assert [r.cpus for r in plan] == [cpus("0-1"), cpus("2-3"), cpus("4-5"), cpus("6-7")]
    assert [r.threads for r in plan] == [2, 2, 2, 2]
    # 2 ranks on 2 nodes: a node each; 1 rank: both nodes
    plan = plan_ranks(2, CpuAffinity(AffinityMode.AUTO), cpus=cpus("0-7"), nodes=nodes)
    assert [r.cpus for r in plan] == nodes
    plan = plan_ranks(1, CpuAffinity(AffinityMode.AUTO), cpus=cpus("0-7"), nodes=nodes)
    assert [r.cpus for r in plan] == [cpus("0-7")]
    # 3 ranks on 2 nodes: no block straddles a node
    plan = plan_ranks(3, CpuAffinity(AffinityMode.AUTO), cpus=cpus("0-7"), nodes=nodes)
    assert all(any(r.cpus is not None and r.cpus <= n for n in nodes) for r in plan)
    # no NUMA information: blocks of the usable CPUs; more ranks than CPUs share them
    plan = plan_ranks(3, CpuAffinity(AffinityMode.AUTO), cpus=cpus("0-1"))
    assert [r.cpus for r in plan] == [{0}, {0}, {1}] and [r.threads for r in plan] == [1, 1, 1]


def test_numa_affinity_binds_ranks_to_whole_nodes() -> None:
    nodes = [cpus("0-3"), cpus("4-7")]
    plan = plan_ranks(4, CpuAffinity(AffinityMode.NUMA), cpus=cpus("0-7"), nodes=nodes)
    assert [r.cpus for r in plan] == [nodes[0], nodes[0], nodes[1], nodes[1]]
    assert [r.threads for r in plan] == [2, 2, 2, 2]  # two ranks share a 4-CPU node


def test_affinity_respects_the_usable_mask() -> None:
    nodes = [cpus("0-3"), cpus("4-7")]
    plan = plan_ranks(2, CpuAffinity(AffinityMode.AUTO), cpus=cpus("2-5"), nodes=nodes)
    assert [r.cpus for r in plan] == [cpus("2-3"), cpus("4-5")]


def test_explicit_affinity() -> None:
    aff = parse_cpu_affinity("0-3:4-7", nproc=2)
    assert aff.mode is AffinityMode.LIST and str(aff) == "0-3:4-7"
    plan = plan_ranks(2, aff, cpus=cpus("0-15"))
    assert [r.cpus for r in plan] == [cpus("0-3"), cpus("4-7")] and [r.threads for r in plan] == [4, 4]
    with pytest.raises(ConfigError, match="CPU\\(s\\) 9 of local rank 1 are not usable"):
        plan_ranks(2, parse_cpu_affinity("0:9"), cpus=cpus("0-7"))


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("sometimes", "valid: none, auto, numa"),
        ("0-3::4", "an empty CPU list"),
        ("0-3:4-7:8", "names 3 rank(s), but --nproc-per-node is 2"),
        ("3-1:4", "runs backwards"),
    ],
)
def test_bad_affinity_is_one_line(text: str, needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_cpu_affinity(text, nproc=2)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_modes_parse_case_insensitively() -> None:
    assert parse_cpu_affinity(" AUTO ").mode is AffinityMode.AUTO
    assert parse_cpu_affinity("numa").mode is AffinityMode.NUMA
    assert parse_cpu_affinity("none") == NONE


def test_visible_gpus_from_cuda_visible_devices_then_dev(tmp_path: Path) -> None:
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        (tmp_path / name).touch()
    assert visible_gpus({}, dev=tmp_path) == 2  # the device files, not the control nodes
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "1"}, dev=tmp_path) == 1
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-3f2a,GPU-99b1"}, dev=tmp_path) == 2
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,-1,1"}, dev=tmp_path) == 1  # CUDA stops at -1
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, dev=tmp_path) == 0
    assert visible_gpus({}, dev=tmp_path / "missing") == 0
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,1"}, dev=tmp_path / "missing") == 0  # a CPU host


def test_dist_plan_per_local_rank() -> None:
    assert dist_plan("auto", 0, 0) == DistPlan("gloo", "cpu")
    assert dist_plan("gloo", 3, 0) == DistPlan("gloo", "cpu")
    assert dist_plan("auto", 1, 2) == DistPlan("cpu:gloo,cuda:nccl", "cuda:1")
    assert dist_plan("nccl", 0, 1) == DistPlan("cpu:gloo,cuda:nccl", "cuda:0")
    assert dist_plan("gloo", 3, 2) == DistPlan("gloo", "cuda:1")  # ranks share GPUs round robin
    with pytest.raises(ConfigError, match="3 ranks per node but 2 GPU"):
        dist_plan("auto", 2, 2)
    with pytest.raises(ConfigError, match="needs a GPU"):
        dist_plan("nccl", 0, 0)

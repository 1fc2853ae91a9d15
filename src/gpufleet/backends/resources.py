"""Worker resource defaults: each rank's thread count and, optionally, its CPUs.

One place for every backend that starts ranks on a host (local, and the node agent that the Slurm,
Kubernetes and Ray backends run): :func:`plan_ranks` says, per local rank, how many threads it gets
and which CPUs it may run on; :func:`thread_env` turns the thread count into the standard variables
unless the user set them.

**Threads.** PyTorch (OpenMP, MKL, OpenBLAS) starts one thread per CPU in *every* process, so N
ranks on one host run N times as many busy threads as there are CPUs and fight over them
(docs/benchmarks.md, P9: 10.9x slower than torchrun on a 2-CPU host). Like torchrun, each rank gets
``OMP_NUM_THREADS`` (and the MKL/OpenBLAS/... equivalents) unless the user exported it. Unlike
torchrun's fixed 1, the value is the rank's share of the host's usable CPUs: the affinity mask
(``os.sched_getaffinity``), capped by a cgroup CPU quota (v2 ``cpu.max``, v1
``cpu.cfs_quota_us``), divided by the ranks; at least 1.

**Affinity** (``--cpu-affinity``): ``none`` (default: inherit), ``auto`` (each rank its own block of
CPUs, blocks inside one NUMA node where the host has several), ``numa`` (each rank every CPU of its
NUMA node; ranks spread evenly over the nodes), or explicit per-rank CPU lists separated by ``:``
(``0-3:4-7``). NUMA nodes come from ``/sys/devices/system/node``.

**GPUs.** With a GPU, local rank *i* uses GPU *i* and torch.distributed runs NCCL for CUDA tensors
and gloo for CPU ones (``cpu:gloo,cuda:nccl``, so gpufleet's small CPU control collectives and a
script's own CPU ones work beside NCCL). NCCL needs one GPU per rank, so ``gpufleet run`` refuses
more local ranks than visible GPUs before it launches anything; ``--dist-backend gloo`` lets ranks
share GPUs (round robin), which is slow but lets a multi-rank job run on a one-GPU workstation.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from gpufleet.core.env import Platform
from gpufleet.core.errors import ConfigError

__all__ = [
    "THREAD_VARS",
    "AffinityMode",
    "CpuAffinity",
    "RankResources",
    "parse_cpulist",
    "format_cpulist",
    "parse_cpu_affinity",
    "cgroup_cpu_limit",
    "numa_nodes",
    "usable_cpus",
    "plan_ranks",
    "host_plan",
    "thread_env",
    "thread_note",
    "visible_gpus",
    "DistPlan",
    "dist_plan",
]

# The thread-count variables of the usual math libraries. OMP_NUM_THREADS rules: if the user set it,
# none is touched (MKL and OpenBLAS fall back to it themselves).
THREAD_VARS = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
)


class AffinityMode(StrEnum):
    NONE = "none"  # inherit the supervisor's CPUs
    AUTO = "auto"  # an exclusive block per rank, NUMA-local where possible
    NUMA = "numa"  # every CPU of the rank's NUMA node
    LIST = "list"  # explicit per-rank lists


@dataclass(frozen=True)
class CpuAffinity:
    """A parsed ``--cpu-affinity``: a mode, and for ``list`` one CPU set per local rank."""

    mode: AffinityMode = AffinityMode.NONE
    lists: tuple[frozenset[int], ...] = ()

    def __str__(self) -> str:
        if self.mode is AffinityMode.LIST:
            return ":".join(format_cpulist(c) for c in self.lists)
        return self.mode.value


@dataclass(frozen=True)
class RankResources:
    """What one local rank gets: its thread count, and its CPUs (None: inherit)."""

    threads: int
    cpus: frozenset[int] | None = None


_CPULIST = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")


def parse_cpulist(text: str) -> frozenset[int]:
    """``0-3,8,10-11`` (the kernel's cpulist format) -> the CPU numbers; ValueError if malformed."""
    text = text.strip()
    if not text:
        return frozenset()
    if not _CPULIST.match(text):
        raise ValueError(f"{text!r} is not a CPU list like 0-3,8")
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        a, b = int(lo), int(hi or lo)
        if b < a:
            raise ValueError(f"{part!r}: the range runs backwards")
        out.update(range(a, b + 1))
    return frozenset(out)


def format_cpulist(cpus: Sequence[int] | frozenset[int] | set[int]) -> str:
    """The CPU numbers as a compact cpulist (``0-3,8``)."""
    items = sorted(cpus)
    runs: list[str] = []
    i = 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1] == items[j] + 1:
            j += 1
        runs.append(str(items[i]) if i == j else f"{items[i]}-{items[j]}")
        i = j + 1
    return ",".join(runs)


def parse_cpu_affinity(text: str, nproc: int | None = None) -> CpuAffinity:
    """Parse ``--cpu-affinity``: none, auto, numa, or ``:``-separated CPU lists, one per local rank.

    ``nproc``: when given, an explicit list must name exactly that many ranks. Errors are ConfigErrors
    of one line that list the valid forms.
    """
    t = text.strip().lower()
    for mode in (AffinityMode.NONE, AffinityMode.AUTO, AffinityMode.NUMA):
        if t == mode.value:
            return CpuAffinity(mode)
    forms = "none, auto, numa, or one CPU list per local rank separated by ':' (0-3:4-7)"
    try:
        lists = tuple(parse_cpulist(part) for part in t.split(":"))
    except ValueError as e:
        raise ConfigError(f"--cpu-affinity {text!r}: {e}; valid: {forms}") from None
    if any(not c for c in lists):
        raise ConfigError(f"--cpu-affinity {text!r}: an empty CPU list; valid: {forms}")
    if nproc is not None and len(lists) != nproc:
        raise ConfigError(
            f"--cpu-affinity {text!r} names {len(lists)} rank(s), but --nproc-per-node is {nproc}"
        )
    return CpuAffinity(AffinityMode.LIST, lists)


def usable_cpus() -> frozenset[int]:
    """The CPUs this process may run on (its affinity mask)."""
    return frozenset(os.sched_getaffinity(0))


def cgroup_cpu_limit(
    cgroup_root: str | os.PathLike[str] = "/sys/fs/cgroup",
    proc_cgroup: str | os.PathLike[str] = "/proc/self/cgroup",
) -> float | None:
    """The CPU quota of this process's cgroup, in CPUs (``1.5``), or None when there is none.

    cgroup v2: ``cpu.max`` (``QUOTA PERIOD`` or ``max PERIOD``) of this cgroup and every ancestor;
    the smallest wins. cgroup v1: ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (-1: none) under the
    ``cpu`` controller's hierarchy. Unreadable files count as no limit.
    """
    root = Path(cgroup_root)
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        lines = []
    limits: list[float] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        rel = path.strip().lstrip("/")
        if controllers == "":  # v2 unified hierarchy
            base = root if (root / "cgroup.controllers").exists() else root / "unified"
            here = base / rel if rel else base
            while True:
                limits += _v2_limit(here / "cpu.max")
                if here == base or base not in here.parents:
                    break
                here = here.parent
        elif "cpu" in controllers.split(","):  # v1 cpu controller
            for name in (controllers, "cpu", "cpu,cpuacct", "cpuacct,cpu"):
                mount = root / name
                if mount.is_dir():
                    break
            else:
                continue
            here = mount / rel if rel else mount
            while True:
                limits += _v1_limit(here)
                if here == mount or mount not in here.parents:
                    break
                here = here.parent
    return min(limits) if limits else None


def _v2_limit(path: Path) -> list[float]:
    try:
        quota, _, period = path.read_text().strip().partition(" ")
        if quota == "max":
            return []
        q, p = int(quota), int(period or "100000")
    except (OSError, ValueError):
        return []
    return [q / p] if q > 0 and p > 0 else []


def _v1_limit(here: Path) -> list[float]:
    try:
        q = int((here / "cpu.cfs_quota_us").read_text().strip())
        p = int((here / "cpu.cfs_period_us").read_text().strip())
    except (OSError, ValueError):
        return []
    return [q / p] if q > 0 and p > 0 else []


def numa_nodes(root: str | os.PathLike[str] = "/sys/devices/system/node") -> list[frozenset[int]]:
    """The CPUs of each NUMA node with any (sorted by node number); ``[]`` where sysfs has no nodes."""
    out: list[tuple[int, frozenset[int]]] = []
    try:
        entries = list(Path(root).iterdir())
    except OSError:
        return []
    for entry in entries:
        m = re.fullmatch(r"node(\d+)", entry.name)
        if not m:
            continue
        try:
            cpus = parse_cpulist((entry / "cpulist").read_text())
        except (OSError, ValueError):
            continue
        if cpus:
            out.append((int(m.group(1)), cpus))
    return [c for _, c in sorted(out, key=lambda x: x[0])]


def _split(items: list[int], parts: int) -> list[list[int]]:
    """``items`` in ``parts`` contiguous blocks as even as possible; with fewer items, they are shared."""
    if len(items) >= parts:
        q, r = divmod(len(items), parts)
        out, i = [], 0
        for k in range(parts):
            n = q + (1 if k < r else 0)
            out.append(items[i : i + n])
            i += n
        return out
    return [[items[k * len(items) // parts]] for k in range(parts)]


def plan_ranks(
    nproc: int,
    affinity: CpuAffinity,
    *,
    cpus: frozenset[int],
    quota: float | None = None,
    nodes: Sequence[frozenset[int]] = (),
) -> list[RankResources]:
    """Threads and CPUs for each of ``nproc`` local ranks on a host with usable ``cpus``.

    ``quota``: a cgroup CPU limit (CPUs), ``nodes``: NUMA nodes' CPUs. The thread budget is
    ``min(len(cpus), floor(quota))``; each rank gets ``budget // nproc`` threads (at least 1), or
    fewer if its own CPUs are fewer. Explicit lists must be subsets of ``cpus`` (ConfigError).
    """
    if nproc < 1:
        raise ValueError("nproc must be >= 1")
    budget = len(cpus)
    if quota is not None:
        budget = min(budget, max(1, math.floor(quota)))
    share = max(1, budget // nproc)
    mode = affinity.mode
    if mode is AffinityMode.NONE:
        return [RankResources(share) for _ in range(nproc)]
    if mode is AffinityMode.LIST:
        if len(affinity.lists) < nproc:
            raise ConfigError(f"--cpu-affinity names {len(affinity.lists)} rank(s), need {nproc}")
        out = []
        for k in range(nproc):
            wanted = affinity.lists[k]
            missing = wanted - cpus
            if missing:
                raise ConfigError(
                    f"--cpu-affinity: CPU(s) {format_cpulist(missing)} of local rank {k} are not usable "
                    f"here (usable: {format_cpulist(cpus)})"
                )
            out.append(RankResources(max(1, min(share, len(wanted))), frozenset(wanted)))
        return out
    groups = [sorted(n & cpus) for n in nodes]
    groups = [g for g in groups if g] or [sorted(cpus)]
    if nproc <= len(groups):  # each rank a contiguous run of whole nodes
        sets = [
            sorted(c for g in groups[k * len(groups) // nproc : (k + 1) * len(groups) // nproc] for c in g)
            for k in range(nproc)
        ]
    else:
        node_of = [k * len(groups) // nproc for k in range(nproc)]
        sets = []
        for g_index, g in enumerate(groups):
            ranks = node_of.count(g_index)
            if mode is AffinityMode.NUMA:
                sets += [g] * ranks
            else:
                sets += _split(g, ranks)
    if mode is AffinityMode.NUMA:
        return [
            RankResources(max(1, min(share, len(s) // max(1, sets.count(s)))), frozenset(s)) for s in sets
        ]
    return [RankResources(max(1, min(share, len(s))), frozenset(s)) for s in sets]


def host_plan(nproc: int, affinity: CpuAffinity) -> list[RankResources]:
    """:func:`plan_ranks` for this host: its affinity mask, cgroup quota and NUMA nodes."""
    return plan_ranks(nproc, affinity, cpus=usable_cpus(), quota=cgroup_cpu_limit(), nodes=numa_nodes())


def thread_env(threads: int, environ: Mapping[str, str]) -> dict[str, str]:
    """The thread variables to set for a rank with ``threads`` threads, given the environment it
    inherits: none if the user set ``OMP_NUM_THREADS``, else each one the user did not set."""
    if environ.get("OMP_NUM_THREADS", "") != "":
        return {}
    return {var: str(threads) for var in THREAD_VARS if environ.get(var, "") == ""}


def thread_note(plan: Sequence[RankResources], environ: Mapping[str, str]) -> str | None:
    """The one line to print when ranks get thread defaults (None when the user chose already)."""
    if environ.get("OMP_NUM_THREADS", "") != "":
        return None
    counts = sorted({r.threads for r in plan})
    value = str(counts[0]) if len(counts) == 1 else "/".join(str(r.threads) for r in plan)
    return (
        f"gpufleet: setting OMP_NUM_THREADS={value} (and MKL/OpenBLAS equivalents) for each of "
        f"{len(plan)} worker(s), their share of this host's CPUs; export OMP_NUM_THREADS to choose yourself"
    )


def visible_gpus(environ: Mapping[str, str] | None = None, dev: str | os.PathLike[str] = "/dev") -> int:
    """GPUs a worker started here would see, without importing torch or creating a CUDA context: the
    ``/dev/nvidiaN`` devices, limited by ``CUDA_VISIBLE_DEVICES`` where set (``""`` or ``-1``: none)."""
    try:
        present = sum(1 for e in os.scandir(dev) if re.fullmatch(r"nvidia\d+", e.name))
    except OSError:
        return 0
    listed = Platform.CUDA_VISIBLE_DEVICES.raw(environ)
    if listed is None:
        return present
    ids = []
    for item in listed.split(","):
        item = item.strip()
        if not item or item.startswith("-"):
            break  # CUDA stops at the first invalid entry
        ids.append(item)
    return min(len(ids), present)


@dataclass(frozen=True, slots=True)
class DistPlan:
    """How one worker joins torch.distributed: the process-group backend string and its device."""

    backend: str  # for dist.init_process_group: "gloo" or "cpu:gloo,cuda:nccl"
    device: str  # "cpu" or "cuda:N"


def dist_plan(choice: str, local_rank: int, gpus: int) -> DistPlan:
    """The backend and device of local rank ``local_rank`` on a host with ``gpus`` usable GPUs.

    ``choice`` is the ``dist_backend`` setting (auto, nccl, gloo). ConfigError when NCCL is asked
    for without a GPU for this rank."""
    if gpus <= 0:
        if choice == "nccl":
            raise ConfigError("--dist-backend nccl needs a GPU, and this host has none visible")
        return DistPlan("gloo", "cpu")
    if choice == "gloo":
        return DistPlan("gloo", f"cuda:{local_rank % gpus}")
    if local_rank >= gpus:
        raise ConfigError(
            f"{local_rank + 1} ranks per node but {gpus} GPU(s) visible, and NCCL needs one per rank; "
            f"run -n {gpus}, or let ranks share GPUs with --dist-backend gloo"
        )
    return DistPlan("cpu:gloo,cuda:nccl", f"cuda:{local_rank}")

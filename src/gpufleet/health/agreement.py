"""Driver and firmware agreement across the nodes of a job.

Every node reports its inventory (``gpu.versions``: NVIDIA driver, GPU VBIOS, InfiniBand HCA firmware).
:func:`odd_nodes` compares the inventories of a job's nodes key by key: a node whose value differs from
the one most nodes share is odd. When no value is shared by more than half of the nodes, there is no
majority to go by and every node is listed as disagreeing. :func:`apply_agreement` turns the findings
into results in each odd node's report: a different driver is a FAIL (the job's collectives and CUDA
behaviour differ between nodes), different firmware a WARN.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path

from gpufleet.health.nvml import GpuReading
from gpufleet.health.results import CheckResult, Report, Status

__all__ = ["node_inventory", "odd_nodes", "apply_agreement", "CHECK", "FAIL_KEYS"]

CHECK = "gpu.versions"
FAIL_KEYS = frozenset({"driver"})


def node_inventory(gpus: Sequence[GpuReading], sysfs: Path | None = None) -> dict[str, str]:
    """{"driver": ..., "vbios": ..., "hca_fw": ...} of one node (keys it cannot read are left out;
    several distinct values are joined with "+")."""
    inv: dict[str, str] = {}
    for key in ("driver", "vbios"):
        vals = sorted({str(g.values[key]) for g in gpus if key in g.values})
        if vals:
            inv[key] = "+".join(vals)
    if sysfs is not None:
        fws = set()
        for f in (sysfs / "class" / "infiniband").glob("*/fw_ver"):
            try:
                fws.add(f.read_text().strip())
            except OSError:
                continue
        if fws:
            inv["hca_fw"] = "+".join(sorted(fws))
    return inv


def odd_nodes(inventories: Mapping[str, Mapping[str, str]]) -> dict[str, list[str]]:
    """{node: ["driver 535.x (most nodes: 550.y, 7 of 8)", ...]} for every node that differs."""
    out: dict[str, list[str]] = {}
    keys = sorted({k for inv in inventories.values() for k in inv})
    for key in keys:
        have = {n: inv[key] for n, inv in inventories.items() if key in inv}
        if len(have) < 2:
            continue
        counts = Counter(have.values())
        if len(counts) == 1:
            continue
        (top, n_top), *_ = counts.most_common()
        if n_top * 2 > len(have):
            for node, v in have.items():
                if v != top:
                    out.setdefault(node, []).append(f"{key} {v} (most nodes: {top}, {n_top} of {len(have)})")
        else:
            seen = ", ".join(f"{v} on {c}" for v, c in counts.most_common())
            for node, v in have.items():
                out.setdefault(node, []).append(f"{key} {v}: no majority ({seen})")
    return out


def apply_agreement(reports: Sequence[Report]) -> dict[str, list[str]]:
    """Compare the ``gpu.versions`` inventories of ``reports`` (one per node of a job) and add a
    ``gpu.versions`` result to each odd node's report; returns :func:`odd_nodes`' findings."""
    inventories = {}
    for rep in reports:
        for r in rep.results:
            if r.check == CHECK and r.data.get("inventory"):
                inventories[rep.node] = dict(r.data["inventory"])
    found = odd_nodes(inventories)
    for rep in reports:
        problems = found.get(rep.node)
        if not problems:
            continue
        fail = any(p.split(" ", 1)[0] in FAIL_KEYS for p in problems)
        rep.results.append(
            CheckResult(
                CHECK,
                Status.FAIL if fail else Status.WARN,
                detail=f"differs from the job's other nodes: {'; '.join(problems)}",
                hint="install the driver and firmware the other nodes run (or drain this node for the job)",
                component="software",
                device="job",
                data={"relative": "job", "nodes": len(inventories)},
            )
        )
    return found

"""Rendering of a :class:`~gpufleet.serve.pack.PackResult`: a headline, Rich tables, a PNG of the racks.

The picture: each NVLink domain is a column of GPU slots (bottom up), colored by workload; P/D
groups are outlined in black; unused slots are light grey. Rich and matplotlib load lazily.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpufleet.serve.pack.solver import Solver

if TYPE_CHECKING:
    from rich.table import Table

    from gpufleet.serve.pack.solver import PackResult

__all__ = ["headline", "tables", "plot_racks", "write_json"]


def _num(x: float) -> str:
    return f"{x:.4g}"


def headline(r: PackResult) -> str:
    """One line: status, cost, bound, gap, time, solver settings."""
    used = sum(1 for x in r.loads() if x)
    how = (
        "first-fit decreasing"
        if r.params.get("solver") == Solver.FFD
        else f"CP-SAT, {r.params.get('num_workers')} workers, seed {r.params.get('seed')}, "
        f"limit {r.params.get('time_limit_s'):g}s"
    )
    s = (
        f"{r.status}: cost {_num(r.cost)} ({used}/{len(r.fleet)} domains, {sum(r.loads())} GPUs placed, "
        f"fragmentation {r.fragmentation}), bound {_num(r.bound)}, gap {r.gap:.1%}; "
        f"placement by {r.method}; {r.solve_s:.2f}s ({how})"
    )
    if r.ffd_cost is not None and r.method != Solver.FFD:
        s += f"; FFD alone: cost {_num(r.ffd_cost)}, gap {r.ffd_gap or 0.0:.1%}"
    return s


def tables(r: PackResult) -> list[Table]:
    """Per-domain placement (used domains) and per-workload summary."""
    from rich.table import Table

    doc = r.to_json()
    dt = Table(title="placement by NVLink domain")
    for c in ("domain", "type", "used", "free", "workloads (GPUs)"):
        dt.add_column(c, justify="right" if c in ("used", "free") else "left")
    idle = 0
    for d in doc["domains"]:
        if not d["used"]:
            idle += 1
            continue
        wl = ", ".join(f"{k} {v}" for k, v in d["workloads"].items())
        dt.add_row(d["name"], d["type"], f"{d['used']}/{d['gpus']}", str(d["free"]), wl)
    if idle:
        dt.caption = f"{idle} domain(s) unused"
    wt = Table(title="workloads")
    for c in ("workload", "mode", "GPUs", "instances", "P/D groups", "domains"):
        wt.add_column(c, justify="right" if c in ("GPUs", "instances", "P/D groups") else "left")
    per: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for p in doc["placements"]:
        per[p["workload"]].append(p)
    for w in r.workloads:
        ps = per[w.name]
        doms = sorted({p["domain"] for p in ps}, key=lambda n: [d.name for d in r.fleet].index(n))
        pds = len({p["pd_group"] for p in ps if p["pd_group"] is not None})
        wt.add_row(
            w.name,
            w.mode + (" (anti)" if w.anti_affinity or r.params.get("anti_affinity") else ""),
            str(w.gpus),
            str(len(ps)),
            str(pds),
            ", ".join(doms),
        )
    return [dt, wt]


def write_json(path: Path, obj: dict[str, Any]) -> Path:
    """Atomic (tmp + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def plot_racks(r: PackResult, path: Path) -> Path:
    """Draw the racks to ``path`` (PNG). Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    names = [w.name for w in r.workloads]
    cmap = plt.get_cmap("tab20" if len(names) > 10 else "tab10")
    color = {n: cmap(i % cmap.N) for i, n in enumerate(names)}
    tallest = max(d.gpus for d in r.fleet)
    cols = len(r.fleet)
    fig_w = min(40.0, max(4.0, 0.45 * cols + 2.5))
    fig_h = min(30.0, max(3.0, 0.11 * tallest + 1.8))
    fig, ax = plt.subplots(figsize=(fig_w, fig_h))
    for d, dom in enumerate(r.fleet):
        ax.add_patch(Rectangle((d - 0.4, 0), 0.8, dom.gpus, facecolor="#eeeeee", edgecolor="#999999", lw=0.6))
    slots = r.slots()
    for i, it in enumerate(r.items):
        d = r.assign[i]
        s0, s1 = slots[i]
        s = s0
        for g in it.groups:
            ax.add_patch(
                Rectangle(
                    (d - 0.38, s + 0.05),
                    0.76,
                    g.gpus - 0.1,
                    facecolor=color[it.workload],
                    edgecolor="white",
                    lw=0.4,
                    hatch="//" if g.role == "prefill" else None,
                )
            )
            s += g.gpus
        if it.role == "pd":
            ax.add_patch(Rectangle((d - 0.42, s0), 0.84, s1 - s0, fill=False, edgecolor="black", lw=1.8))
    ax.set_xlim(-0.6, cols - 0.4)
    ax.set_ylim(0, tallest)
    step = max(1, cols // 40)
    ax.set_xticks(range(0, cols, step))
    ax.set_xticklabels([r.fleet[d].name for d in range(0, cols, step)], rotation=90, fontsize=7)
    ax.set_ylabel("GPU slot")
    ax.set_title(
        f"{r.status}: cost {_num(r.cost)}, bound {_num(r.bound)}, gap {r.gap:.1%} "
        f"({r.method})\nhatched: prefill; black outline: P/D group",
        fontsize=8,
    )
    handles = [Patch(facecolor=color[n], label=n) for n in names]
    ax.legend(
        handles=handles,
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=7,
        ncol=1 + len(names) // 25,
        frameon=False,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

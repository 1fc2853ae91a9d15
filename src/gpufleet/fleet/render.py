"""Terminal tables (rich) and PNG plots (matplotlib) of a fleet summary. Both libraries load lazily."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpufleet.reliability.render import fmt_s as _dur

__all__ = ["render", "plot_goodput_vs_size", "plot_badput", "write_plots"]

_BADPUT_LABELS = {
    "ckpt_stall": "stall",
    "recompute": "recompute",
    "detect": "detect",
    "replace": "replace",
    "restart": "restart",
    "load": "load",
    "planned": "planned",
}


def render(summary: dict[str, Any], console: Any = None) -> None:
    """Interruptions by cause, then the strategy table with ETTR, its 95% CI and the badput stack."""
    from rich.console import Console
    from rich.table import Table

    con = console or Console()
    if console is None and not con.is_terminal:  # piped: wide enough for the tables, no truncation
        con = Console(width=120)
    s = summary
    cal = s.get("calibration")
    con.print(
        f"[bold]Fleet simulation[/bold]: profile [cyan]{s['profile']}[/cyan], {s['gpus']:,} GPUs "
        f"({s['nodes']:,} nodes), {s['days']:g} days, {s['replicates']} replicates, seed {s['seed']}"
    )
    if cal:
        con.print(
            f"calibrated from [cyan]{cal['run_dir']}[/cyan] (world {cal['world_size']}, "
            f"{cal['incidents']} incidents, {cal['checkpoints']} checkpoints): step {_dur(cal['step_s'])}, "
            f"stall {_dur(cal['stall_s'])}, persist {_dur(cal['persist_s'])}, "
            f"detect {_dur(cal['detect_s'])}, "
            f"restart {_dur(cal['restart_s'])}, load {_dur(cal['load_s'])}; failure rates from the profile; "
            "the run's phase times are assumed to hold at this size"
        )
    it = s["interruptions"]
    t = Table(title="Interruptions by cause (first strategy's replicates)", title_justify="left")
    t.add_column("cause")
    t.add_column("mean", justify="right")
    t.add_column("95% CI", justify="right")
    t.add_column("per day", justify="right")
    for c in sorted(it["by_cause"], key=lambda c: -c["mean"]):
        if c["mean"] <= 0:
            continue
        t.add_row(
            c["cause"], f"{c['mean']:.1f}", f"{c['ci_low']:.1f}-{c['ci_high']:.1f}", f"{c['per_day']:.2f}"
        )
    u, p = it["unexpected"], it["planned"]
    t.add_row(
        "[bold]unexpected[/bold]",
        f"[bold]{u['mean']:.1f}[/bold]",
        f"{u['ci_low']:.1f}-{u['ci_high']:.1f}",
        f"{u['mean'] / s['days']:.2f}",
    )
    if p["mean"] > 0:
        t.add_row(
            "planned",
            f"{p['mean']:.1f}",
            f"{p['ci_low']:.1f}-{p['ci_high']:.1f}",
            f"{p['mean'] / s['days']:.2f}",
        )
    con.print(t)
    extra = []
    if it["lemon"]:
        extra.append(f"lemon failures {it['lemon']:.1f}")
    if it["early_life"]:
        extra.append(f"early-life failures {it['early_life']:.1f}")
    b = s.get("basis")
    if b and b["gpus"] == s["gpus"] and b["days"] == s["days"]:
        con.print(
            f"published for this job ({b['gpus']:,} GPUs, {b['days']:g} days): {b['unexpected']} unexpected"
            + (f", {b['planned']} planned" if b["planned"] is not None else "")
            + " interruptions"
        )
    con.print(
        f"MTBF (wall, unexpected) [bold]{it['mtbf_h']:.2f} h[/bold]"
        + ("; " + ", ".join(extra) if extra else "")
    )

    best = max(x["ettr"]["mean"] for x in s["strategies"])
    st = Table(
        title="Strategies: effective training time ratio (goodput), % of wall time", title_justify="left"
    )
    for col in ("strategy", "interval", "stall", "persist", "ETTR", "95% CI", "p5-p95"):
        st.add_column(col, justify="left" if col == "strategy" else "right", no_wrap=True)
    for x in s["strategies"]:
        e = x["ettr"]
        st.add_row(
            x["name"],
            _dur(x["interval_s"]),
            _dur(x["stall_s"]),
            _dur(x["persist_s"]) if x["persist_s"] else "-",
            f"{100 * e['mean']:.2f}",
            f"{100 * e['ci_low']:.2f}-{100 * e['ci_high']:.2f}",
            f"{100 * e['p5']:.1f}-{100 * e['p95']:.1f}",
            style="bold green" if e["mean"] == best else None,
        )
    con.print(st)
    bt = Table(title="Badput by category, % of wall time (means)", title_justify="left")
    bt.add_column("strategy", no_wrap=True)
    for lab in _BADPUT_LABELS.values():
        bt.add_column(lab, justify="right")
    for x in s["strategies"]:
        bt.add_row(x["name"], *[f"{100 * x['badput_share'][k]['mean']:.2f}" for k in _BADPUT_LABELS])
    con.print(bt)
    for k in ("goodput_png", "badput_png"):
        if s.get(k):
            con.print(f"{k.replace('_png', '')} plot: {s[k]}")


def plot_goodput_vs_size(summary: dict[str, Any], path: Path) -> Path:
    """Goodput (ETTR) against job size, one line per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sw = summary["sweep"]
    fig, ax = plt.subplots(figsize=(8, 5))
    methods = list(dict.fromkeys(n.split("+", 1)[0] for n in sw["ettr"]))
    colours = plt.get_cmap("tab10")
    for name, ys in sw["ettr"].items():
        ax.plot(
            sw["gpus"],
            [100 * y for y in ys],
            marker="o",
            ms=3,
            label=name,
            color=colours(methods.index(name.split("+", 1)[0])),
            linestyle="--" if "+spares" in name else "-",
        )
    ax.set_xscale("log")
    ax.set_xlabel("GPUs in the job")
    ax.set_ylabel("goodput (ETTR), % of wall time")
    ax.set_title(
        f"{summary['profile']}: goodput vs job size ({summary['days']:g} days, "
        f"{sw['replicates']} replicates per point)"
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_badput(summary: dict[str, Any], path: Path) -> Path:
    """Stacked badput per strategy at the requested size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [x["name"] for x in summary["strategies"]]
    fig, ax = plt.subplots(figsize=(9, 5))
    bottom = [0.0] * len(names)
    for k, lab in _BADPUT_LABELS.items():
        vals = [100 * x["badput_share"][k]["mean"] for x in summary["strategies"]]
        ax.bar(names, vals, bottom=bottom, label=lab)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_ylabel("badput, % of wall time")
    ax.set_title(f"{summary['profile']}: badput at {summary['gpus']:,} GPUs, {summary['days']:g} days")
    ax.legend(fontsize=8)
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(summary: dict[str, Any], out_dir: Path) -> dict[str, str]:
    """Both PNGs into ``out_dir``; their paths by key (``goodput_png``, ``badput_png``)."""
    out: dict[str, str] = {}
    if summary.get("sweep"):
        out["goodput_png"] = str(plot_goodput_vs_size(summary, out_dir / "goodput_vs_size.png"))
    out["badput_png"] = str(plot_badput(summary, out_dir / "badput.png"))
    return out

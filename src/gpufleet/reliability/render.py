"""Terminal rendering of a report summary (the object from :func:`metrics.summarize`) with Rich.

Rich is imported inside :func:`render`, so importing this module is cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["render", "fmt_s", "fmt_bytes"]

_LABELS = {
    "productive": "productive steps",
    "ckpt_stall": "checkpoint stall",
    "detect": "detect",
    "teardown": "teardown (restart)",
    "spawn_init": "spawn / init",
    "load": "load checkpoint",
    "recompute": "recompute (rolled back)",
    "idle": "idle / other",
    "first_step": "first step",
}


_IN_PLACE_LABELS = {
    "supervisor": "detect + stop the lost rank",
    "abort": "abort (survivors leave the round)",
    "rendezvous": "re-rendezvous (new round, groups)",
    "first_step": "first step",
}
# Where an in-place restore read the state, as the table names it.
_SOURCE_LABELS = {
    "process": "own memory",
    "memory": "node memory tier",
    "peer_memory": "peer transfer",
    "local": "disk",
    "s3": "S3",
}


def _in_place_table(con: Console, ip: dict[str, Any]) -> None:
    from rich.table import Table

    n = ip["count"]
    t = Table(title=f"In-process recoveries ({n}): their own phases", title_justify="left")
    t.add_column("phase")
    t.add_column("mean", justify="right")
    t.add_column("share", justify="right")
    sources = ", ".join(f"{_SOURCE_LABELS.get(k, k)} {v}" for k, v in sorted(ip["restore_sources"].items()))
    for k, v in ip["phases_mean_s"].items():
        label = f"restore ({sources})" if k == "restore" else _IN_PLACE_LABELS.get(k, k)
        t.add_row(label, fmt_s(v), _pct(v / ip["mean_s"] if ip["mean_s"] else None))
    con.print(t)


def fmt_s(x: float | None) -> str:
    """Seconds for humans: 850 ms, 12.3 s, 4 m 05 s, 3 h 07 m."""
    if x is None:
        return "—"
    if x < 1.0:
        return f"{x * 1000:.0f} ms"
    if x < 60.0:
        return f"{x:.1f} s"
    if x < 3600.0:
        m, s = divmod(round(x), 60)
        return f"{m} m {s:02d} s"
    h, m = divmod(round(x / 60.0), 60)
    return f"{h} h {m:02d} m"


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "—"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024.0 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024.0
    return f"{n:.1f} TiB"


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100.0 * x:.1f}%"


def _spikes(sp: dict[str, Any]) -> str:
    """One line: alarms by kind and outcome, then the false alarms (docs/reliability.md)."""
    out = sp["outcome"]
    parts = [f"{sp['flagged']} flagged"]
    if sp["injected"]:
        parts.append(f"{sp['injected']} injected")
    if out["transient"]:
        parts.append(f"{out['transient']} transient (the replay cleared it)")
    if out["data_driven"]:
        parts.append(
            f"{out['data_driven']} data-driven (the replay reproduced it, {sp['identical']} identically;"
            " its batches skipped)"
        )
    if out["unresolved"]:
        parts.append(f"{out['unresolved']} unresolved")
    style = "bold red" if sp["false_alarms"] else "green"
    return ", ".join(parts) + f"; [{style}]false alarms {sp['false_alarms']}[/]"


def render(summary: dict[str, Any], console: Console | None = None) -> None:
    """Print the report: summary, MTTR phases, badput, failures, checkpoints, interval decisions."""
    from rich.console import Console
    from rich.table import Table

    con = console or Console()
    s = summary
    sessions = s["sessions"]
    status = ", ".join(str(x["status"] or "running/unknown") for x in sessions) or "—"
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    head.add_row("run dir", str(s.get("run_dir") or "—"))
    head.add_row("sessions", f"{len(sessions)}  (status: {status})")
    head.add_row("wall time", fmt_s(s["wall_s"]))
    st = s["steps"]
    head.add_row(
        "steps",
        f"{st['productive']} kept, {st['rolled_back']} rolled back"
        f" (last step {st['last_step'] if st['last_step'] is not None else '—'},"
        f" mean {fmt_s(st['mean_step_s'])})",
    )
    head.add_row("goodput", f"[bold green]{_pct(s['goodput'])}[/]  (productive step time ÷ wall time)")
    f = s["failures"]
    head.add_row(
        "failures", f"{f['count']}" + (f"  ({f['unrecovered']} unrecovered)" if f["unrecovered"] else "")
    )
    head.add_row("MTBF", fmt_s(s["mtbf_s"]) + f"  (uptime {fmt_s(s['uptime_s'])} ÷ failures)")
    m = s["mttr"]
    head.add_row("MTTR", f"{fmt_s(m['mean_s'])}  (p50 {fmt_s(m['p50_s'])}, max {fmt_s(m['max_s'])})")
    head.add_row("restarts / rollbacks", f"{s['restarts']} / {s['rollbacks']}")
    if s.get("skipped_windows"):
        head.add_row("skipped batches", f"{s['skipped_steps']} steps in {s['skipped_windows']} window(s)")
    sp = s.get("spikes")
    if sp is not None:
        head.add_row("loss spikes", _spikes(sp))
    for g in s.get("stragglers", []):
        where = f" on {g['node']}" if g["node"] else ""
        head.add_row(
            "straggler",
            f"[yellow]rank {g['rank']}{where}[/]: {g['section']} {fmt_s(g['seconds'])} per step vs "
            f"{fmt_s(g['peers_s'])} for its peers ({g['ratio']:.1f}x), "
            f"attempt {g['attempt']}, step {g['step']}",
        )
    con.print(head)

    if m["count"]:
        t = Table(
            title="MTTR: failure → first step after restore (mean over recoveries)", title_justify="left"
        )
        t.add_column("phase")
        t.add_column("mean", justify="right")
        t.add_column("share", justify="right")
        for k, v in m["phases_mean_s"].items():
            t.add_row(
                _LABELS.get(k, k), fmt_s(v), _pct(v / m["mean_s"] if v is not None and m["mean_s"] else None)
            )
        t.add_row("[dim]recompute (separate)[/]", f"[dim]{fmt_s(m['recompute_mean_s'])}[/]", "")
        con.print(t)
    if m.get("in_process"):
        _in_place_table(con, m["in_process"])

    t = Table(title="Where the wall time went", title_justify="left")
    t.add_column("category")
    t.add_column("time", justify="right")
    t.add_column("share", justify="right")
    for k, v in s["badput"].items():
        style = "green" if k == "productive" else ""
        t.add_row(
            f"[{style}]{_LABELS.get(k, k)}[/]" if style else _LABELS.get(k, k),
            fmt_s(v["s"]),
            _pct(v["share"]),
        )
    con.print(t)

    if s["incidents"]:
        t = Table(title="Failures", title_justify="left")
        for col in ("#", "cause", "rank", "step", "recovered", "path", "MTTR", "lost steps", "recompute"):
            t.add_column(col, justify="right" if col not in ("cause", "recovered", "path") else "left")
        for i, inc in enumerate(s["incidents"], 1):
            t.add_row(
                str(i),
                inc["cause"],
                str(inc["rank"] if inc["rank"] is not None else "—"),
                str(inc["step"] if inc["step"] is not None else "—"),
                "yes" if inc["recovered"] else "[red]no[/]",
                inc["path"].replace("_", "-") if inc["recovered"] else "—",
                fmt_s(inc["mttr_s"]),
                str(inc["lost_steps"]),
                fmt_s(inc["recompute_s"]),
            )
        con.print(t)
        by = ", ".join(f"{k} {v}" for k, v in sorted(f["by_cause"].items()))
        con.print(f"failures by cause: {by}")

    ck = s["checkpoints"]
    t = Table(title="Checkpoints", title_justify="left")
    t.add_column("")
    t.add_column("count / p50", justify="right")
    t.add_column("p95", justify="right")
    t.add_column("max", justify="right")
    t.add_row(
        "committed / failed / skipped",
        f"{ck['committed']} / {ck['failed']} / {ck['skipped']}",
        f"uploaded {ck['uploaded']}",
        f"deleted {ck['deleted']}",
    )
    for key, label in (
        ("stall_s", "stall (blocks training)"),
        ("persist_s", "persist"),
        ("upload_s", "upload"),
    ):
        d = ck[key]
        if d["count"]:
            t.add_row(label, fmt_s(d["p50"]), fmt_s(d["p95"]), fmt_s(d["max"]))
    t.add_row(
        "size (last) / committed total",
        fmt_bytes(ck["bytes_last"]),
        fmt_bytes(ck["bytes_committed_total"]),
        "",
    )
    if ck["restore_rejected"]:
        t.add_row("[yellow]restores rejected (verify)[/]", str(ck["restore_rejected"]), "", "")
    con.print(t)

    if s["interval"]:
        t = Table(title="Checkpoint interval decisions", title_justify="left")
        for col in ("step", "policy", "every steps", "every", "δ stall", "MTBF", "persist"):
            t.add_column(col, justify="left" if col == "policy" else "right")
        for d in s["interval"][-10:]:
            pol = str(d.get("policy"))
            if d.get("model"):
                pol += f" ({d['model']})"
            t.add_row(
                str(d.get("step", "—")),
                pol,
                str(d.get("every_steps") or "—"),
                fmt_s(d.get("every_s")),
                fmt_s(d.get("delta_s")),
                fmt_s(d.get("mtbf_s")),
                fmt_s(d.get("persist_s")),
            )
        con.print(t)

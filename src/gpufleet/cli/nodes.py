"""``gpufleet nodes``: node states, per-node MTBF/MTTR, failures by component, lemons (fleet ledger)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

__all__ = ["register", "nodes"]


def _dur(s: float | None) -> str:
    if s is None:
        return "-"
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n:
            return f"{s / n:.1f}{unit}"
    return f"{s:.0f}s"


def nodes(
    json_out: Annotated[
        bool, typer.Option("--json", help="Print a JSON object (schema gpufleet.nodes/1).")
    ] = False,
    fleet_dir: Annotated[
        Path | None,
        typer.Option(
            "--fleet-dir", help="Fleet state dir (default: $GPUFLEET_FLEET_DIR or ./.gpufleet/fleet)."
        ),
    ] = None,
    lemon_failures: Annotated[
        int | None,
        typer.Option("--lemon-failures", min=1, help="Failures in the window that make a lemon (3)."),
    ] = None,
    lemon_window_days: Annotated[
        float | None, typer.Option("--lemon-window-days", min=0.001, help="The lemon window in days (30).")
    ] = None,
) -> None:
    """Node state, since when, MTBF, MTTR, failures by component and the lemon flag, from the fleet ledger."""
    from gpufleet.health.nodes import exclude_list, node_table
    from gpufleet.health.nodes import fleet_dir as resolve

    if fleet_dir is not None:  # named: it must be there (the default may not exist yet)
        from gpufleet.core.paths import input_dir

        input_dir(fleet_dir, "--fleet-dir")
    now = time.time()
    rows = node_table(fleet_dir, now=now, lemon_failures=lemon_failures, lemon_window_days=lemon_window_days)
    excl = exclude_list(
        fleet_dir, now=now, lemon_failures=lemon_failures, lemon_window_days=lemon_window_days
    )
    if json_out:
        out = {
            "schema": "gpufleet.nodes/1",
            "fleet_dir": str(resolve(fleet_dir)),
            "t": now,
            "nodes": [r.to_dict() for r in rows],
            "exclude": excl,
        }
        typer.echo(json.dumps(out, indent=2))
        return
    if not rows:
        typer.echo(f"no node states in {resolve(fleet_dir)} (run `gpufleet health watch` or check --record)")
        return
    from rich.console import Console
    from rich.table import Table

    colour = {
        "healthy": "green",
        "in_service": "green",
        "validated": "green",
        "suspect": "yellow",
        "drained": "red",
        "repaired": "cyan",
    }
    t = Table(title=f"nodes ({resolve(fleet_dir)})", title_justify="left")
    for col in ("node", "state", "since", "MTBF", "MTTR", "failures", "by component", "lemon", "reason"):
        t.add_column(col, overflow="fold")
    for r in rows:
        since = time.strftime("%Y-%m-%d %H:%M", time.localtime(r.since))
        comp = ", ".join(f"{k} {v}" for k, v in r.failures_by_component.items()) or "-"
        t.add_row(
            r.node,
            f"[{colour.get(r.state, 'white')}]{r.state}[/]",
            since,
            _dur(r.mtbf_s),
            _dur(r.mttr_s),
            str(r.failures),
            comp,
            "[red]LEMON[/]" if r.lemon else "",
            r.reason,
        )
    c = Console(width=None if sys.stdout.isatty() else 160)
    c.print(t)
    c.print(f"exclude list: {','.join(excl) or '(none)'}")


def register(app: typer.Typer) -> None:
    """Add the ``nodes`` command to the main CLI."""
    app.command("nodes")(nodes)

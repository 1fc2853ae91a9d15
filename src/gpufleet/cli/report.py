"""``gpufleet report RUN_DIR [--json] [--plot PATH]``: reliability numbers from a run's ledger.

Thin: reads the ledger, calls :mod:`gpufleet.reliability.metrics`, renders. Rich and matplotlib are
imported inside the command.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gpufleet.core.errors import UsageError

__all__ = ["register", "report"]


def report(
    run_dir: Annotated[Path, typer.Argument(help="Run directory holding ledger.jsonl.")],
    json_out: Annotated[
        bool, typer.Option("--json", help="Print the report as one JSON object (docs/reliability.md).")
    ] = False,
    plot: Annotated[
        Path | None,
        typer.Option("--plot", help="Write the timeline PNG here (default: RUN_DIR/timeline.png)."),
    ] = None,
    no_plot: Annotated[bool, typer.Option("--no-plot", help="Do not write the timeline PNG.")] = False,
) -> None:
    """MTBF, MTTR (with phases), goodput, badput, checkpoint stats and a timeline PNG of a run."""
    import json

    from gpufleet.core.ledger import LEDGER_NAME, read_events
    from gpufleet.core.paths import input_dir, output_file
    from gpufleet.reliability.metrics import summarize

    input_dir(run_dir, "run directory")
    ledger = run_dir / LEDGER_NAME
    if not ledger.is_file():
        raise UsageError(
            f"no ledger in {run_dir} (expected {LEDGER_NAME}); is this a gpufleet run directory?"
        )
    if not no_plot and (plot is not None or not json_out):
        output_file(plot if plot is not None else run_dir / "timeline.png", "--plot")
    events = read_events(ledger)
    if not events:
        raise UsageError(f"the ledger {ledger} holds no events")
    summary = summarize(events, run_dir=str(run_dir))

    png: Path | None = None
    if not no_plot and (plot is not None or not json_out):
        from gpufleet.reliability.timeline import plot_timeline

        png = plot_timeline(
            events, plot if plot is not None else run_dir / "timeline.png", title=str(run_dir)
        )
        summary["timeline_png"] = str(png)
    if json_out:
        typer.echo(json.dumps(summary, indent=2, default=str))
        return
    from gpufleet.reliability.render import render

    render(summary)
    if png is not None:
        typer.echo(f"timeline: {png}")


def register(app: typer.Typer) -> None:
    """Add the ``report`` command to the main CLI."""
    app.command("report")(report)

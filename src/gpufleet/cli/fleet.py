"""``gpufleet fleet simulate``: project goodput to fleet scale (docs/fleet-sim.md).

Thin: flags -> :class:`gpufleet.fleet.simulate.FleetRequest` -> :func:`gpufleet.fleet.simulate.run`
-> a rich table, ``--json`` or PNG plots. numpy, pydantic, rich and matplotlib load inside the command.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

__all__ = ["app", "simulate"]

app = typer.Typer(
    name="fleet",
    help="Fleet reliability simulator: interruptions, goodput, the strategies that buy it (1K-100K GPUs).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.command("simulate")
def simulate(
    profile: Annotated[
        str,
        typer.Option(
            "--profile", help="llama3-h100 | rsc-a100, or a path to a profile TOML (docs/fleet-sim.md)."
        ),
    ] = "llama3-h100",
    gpus: Annotated[
        int | None,
        typer.Option("--gpus", help="GPUs in the job (default: the profile's basis job, else 16384)."),
    ] = None,
    days: Annotated[
        float | None,
        typer.Option("--days", help="Days of wall time (default: the profile's basis, else 30)."),
    ] = None,
    replicates: Annotated[int, typer.Option("--replicates", "-r", help="Monte Carlo replicates.")] = 500,
    seed: Annotated[int, typer.Option("--seed", help="Random seed (same seed, same numbers).")] = 0,
    interval: Annotated[
        str,
        typer.Option(
            "--interval", help="Checkpoint interval of work (90s, 5m, 1h) or auto (Young/Daly per strategy)."
        ),
    ] = "auto",
    spares: Annotated[
        int | None,
        typer.Option(
            "--spares", help="Hot spare nodes of the +spares strategies (default: 1% of nodes, at least 2)."
        ),
    ] = None,
    from_run: Annotated[
        Path | None,
        typer.Option(
            "--from-run",
            help="A gpufleet run dir: MTTR phases, checkpoint stall/persist, step time from its ledger.",
        ),
    ] = None,
    strategy: Annotated[
        list[str] | None,
        typer.Option(
            "--strategy", "-s", help="Only this strategy (repeatable), e.g. sync, peer-inproc+spares."
        ),
    ] = None,
    no_sweep: Annotated[
        bool, typer.Option("--no-sweep", help="Skip the 1K-100K size sweep (and its goodput plot).")
    ] = False,
    plot_dir: Annotated[
        Path | None,
        typer.Option(
            "--plot-dir", help="Where the PNGs go (default: RUN_DIR/fleet with --from-run, else ./fleet-sim)."
        ),
    ] = None,
    no_plot: Annotated[bool, typer.Option("--no-plot", help="Write no PNG.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the gpufleet.fleet/1 JSON object.")] = False,
) -> None:
    """Simulate a job on a fleet: interruptions by cause, MTBF, goodput and badput per strategy (95% CIs)."""
    from gpufleet.core.paths import input_dir, output_dir
    from gpufleet.core.units import parse_duration
    from gpufleet.fleet.simulate import FleetRequest, run

    interval_s = (
        None
        if interval.strip().lower() == "auto"
        else parse_duration(interval, "--interval", allow_zero=False)
    )
    req = FleetRequest(
        profile=profile,
        gpus=gpus,
        days=days,
        replicates=replicates,
        seed=seed,
        interval_s=interval_s,
        spares=spares,
        from_run=from_run,
        only=list(strategy or []),
        sweep=not no_sweep,
    )
    req.validate()
    out = plot_dir or ((from_run / "fleet") if from_run is not None else Path("fleet-sim"))
    if from_run is not None:
        input_dir(from_run, "--from-run")
    if not no_plot:
        output_dir(out, "--plot-dir")
    if json_out or not sys.stderr.isatty():
        summary = run(req)
    else:
        from rich.console import Console

        with Console(stderr=True).status("simulating") as status:
            summary = run(req, progress=lambda msg: status.update(f"simulating {msg}"))
    if not no_plot:
        from gpufleet.fleet.render import write_plots

        summary.update(write_plots(summary, out))
    if json_out:
        typer.echo(json.dumps(summary, indent=2))
        return
    from gpufleet.fleet.render import render

    render(summary)

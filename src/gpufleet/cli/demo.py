"""``gpufleet demo``: train a tiny GPT through a crash, a hang and a NaN, and prove exact recovery."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

__all__ = ["register"]


def demo(
    dir: Path = typer.Option(Path("runs/demo"), "--dir", help="Where the reference and faulted runs go."),
    steps: int = typer.Option(400, "--steps", min=1, max=1_000_000, help="Training steps of each run."),
    nproc: int = typer.Option(2, "--nproc", "-n", min=1, max=64, help="Worker processes per run."),
    seed: int = typer.Option(1234, "--seed", help="Seed of model init, dropout and data order."),
    no_reference: bool = typer.Option(
        False, "--no-reference", help="Skip the reference run (reuse DIR/reference if it matches)."
    ),
    checkpoint_every: int = typer.Option(
        25, "--checkpoint-every", min=1, help="Checkpoint interval in steps."
    ),
    progress: bool | None = typer.Option(
        None, "--progress/--no-progress", help="Live progress view (default: when stderr is a terminal)."
    ),
    no_plot: bool = typer.Option(False, "--no-plot", help="Do not write the timeline PNG."),
    in_process: bool = typer.Option(
        True,
        "--in-process-restart/--full-restart",
        help="Recover the crash and the hang in-process (survivors keep their processes); the NaN "
        "always takes a full restart.",
    ),
) -> int:
    """Run the fault-tolerance demo: reference run, faulted run, report, exact-recovery check."""
    from rich.console import Console

    from gpufleet.core.paths import output_dir
    from gpufleet.demo.runner import DemoConfig, run_demo

    output_dir(dir, "--dir")
    cfg = DemoConfig(
        dir=dir,
        steps=steps,
        nproc=nproc,
        seed=seed,
        reference=not no_reference,
        checkpoint_every=checkpoint_every,
        progress=sys.stderr.isatty() if progress is None else progress,
        plot=not no_plot,
        in_process=in_process,
    )
    result = run_demo(cfg, Console())
    if result.exit_code:
        raise typer.Exit(result.exit_code)
    return 0


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)

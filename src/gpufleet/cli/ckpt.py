"""``gpufleet ckpt``: list and verify the checkpoints of a directory (no torch import)."""

from __future__ import annotations

import datetime as _dt

import typer
from rich.console import Console
from rich.table import Table

from gpufleet.core.errors import UsageError
from gpufleet.core.exitcodes import ExitCode

app = typer.Typer(
    help="Inspect gpufleet checkpoints: list committed ones, verify sizes and checksums.",
    no_args_is_help=True,
)


def _when(t: float) -> str:
    return _dt.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


_DIR_HELP = "a checkpoint (RUN_DIR/checkpoints/step_N), a checkpoints directory or a run directory"


@app.command("list")
def list_cmd(directory: str = typer.Argument(..., metavar="DIR", help=_DIR_HELP)) -> None:
    """List committed checkpoints (valid manifest), newest first. Exit 1 if none is committed."""
    from gpufleet.checkpoint.manifest import read_manifest
    from gpufleet.checkpoint.verify import resolve_target

    target = resolve_target(directory)
    rows = []
    for d in target.dirs:
        try:
            rows.append(read_manifest(d))
        except (OSError, ValueError):
            continue  # torn, missing or foreign manifest: not committed
    table = Table(title=f"checkpoints in {directory}")
    for col in ("step", "committed", "size", "files", "world", "meta"):
        table.add_column(col, justify="right" if col in ("step", "size", "files", "world") else "left")
    for m in sorted(rows, key=lambda m: m.step, reverse=True):
        meta = ", ".join(f"{k}={v}" for k, v in sorted(m.meta.items()) if not isinstance(v, dict | list))
        table.add_row(
            str(m.step), _when(m.time), _size(m.total_bytes), str(len(m.files)), str(m.world_size), meta
        )
    console = Console()
    console.print(table)
    if not rows:
        console.print(f"no committed checkpoints ({len(target.dirs)} uncommitted directories)")
        raise typer.Exit(ExitCode.FAILED)


@app.command("verify")
def verify_cmd(
    directory: str = typer.Argument(..., metavar="DIR", help=_DIR_HELP),
    step: int | None = typer.Option(None, "--step", min=0, help="verify only this step"),
) -> None:
    """Check every file's size and xxh3 checksum against the manifest. Exit 1 if any fails."""
    from gpufleet.checkpoint.manifest import parse_step
    from gpufleet.checkpoint.verify import resolve_target, verify_dir

    target = resolve_target(directory)
    dirs = target.dirs
    if step is not None:
        dirs = [d for d in dirs if parse_step(d.name) == step]
        if not dirs:
            raise UsageError(f"no checkpoint for step {step} in {directory}")
    table = Table(title=f"verify {directory}")
    table.add_column("step", justify="right")
    table.add_column("status")
    table.add_column("detail")
    bad = 0
    with Console().status("verifying checkpoints..."):
        for d in dirs:
            m, reason = verify_dir(d)
            label = str(parse_step(d.name) if parse_step(d.name) is not None else d.name)
            if reason is None and m is not None:
                table.add_row(label, "[green]OK[/green]", f"{len(m.files)} files, {_size(m.total_bytes)}")
            else:
                bad += 1
                table.add_row(label, "[red]REJECTED[/red]", reason or "")
    console = Console()
    console.print(table)
    console.print(f"{len(dirs) - bad} of {len(dirs)} checkpoints verified")
    if bad:
        raise typer.Exit(ExitCode.FAILED)

"""``gpufleet ckpt``: list and verify the checkpoints of a directory (no torch import)."""

from __future__ import annotations

import datetime as _dt
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from gpufleet.core.errors import UsageError

app = typer.Typer(
    help="Inspect gpufleet checkpoints: list committed ones, verify sizes and checksums.",
    no_args_is_help=True,
)


def _root(directory: str) -> Path:
    p = Path(directory)
    if not p.exists():
        raise UsageError(f"no such checkpoint directory: {directory}")
    if not p.is_dir():
        raise UsageError(f"not a directory: {directory}")
    return p


def _when(t: float) -> str:
    return _dt.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


@app.command("list")
def list_cmd(
    directory: str = typer.Argument(..., metavar="DIR", help="checkpoint root (RUN_DIR/checkpoints)"),
) -> None:
    """List committed checkpoints (valid manifest), newest first."""
    from gpufleet.checkpoint.manifest import list_committed

    rows = list_committed(_root(directory))
    table = Table(title=f"checkpoints in {directory}")
    for col in ("step", "committed", "size", "files", "world", "meta"):
        table.add_column(col, justify="right" if col in ("step", "size", "files", "world") else "left")
    for _path, m in rows:
        meta = ", ".join(f"{k}={v}" for k, v in sorted(m.meta.items()) if not isinstance(v, dict | list))
        table.add_row(
            str(m.step), _when(m.time), _size(m.total_bytes), str(len(m.files)), str(m.world_size), meta
        )
    console = Console()
    console.print(table)
    if not rows:
        console.print("no committed checkpoints")


@app.command("verify")
def verify_cmd(
    directory: str = typer.Argument(..., metavar="DIR", help="checkpoint root (RUN_DIR/checkpoints)"),
    step: int | None = typer.Option(None, "--step", help="verify only this step"),
) -> None:
    """Check every file's size and xxh3 checksum against the manifest. Exit 1 if any fails."""
    from gpufleet.checkpoint.manifest import parse_step, step_dirname
    from gpufleet.checkpoint.verify import verify_dir

    root = _root(directory)
    if step is not None:
        target = root / step_dirname(step)
        if not target.is_dir():
            raise UsageError(f"no checkpoint for step {step} in {directory}")
        dirs = [target]
    else:
        dirs = sorted(
            (p for p in root.iterdir() if p.is_dir() and parse_step(p.name) is not None), reverse=True
        )
    table = Table(title=f"verify {directory}")
    table.add_column("step", justify="right")
    table.add_column("status")
    table.add_column("detail")
    bad = 0
    with Console().status("verifying checkpoints..."):
        for d in dirs:
            m, reason = verify_dir(d)
            if reason is None and m is not None:
                table.add_row(
                    str(parse_step(d.name)),
                    "[green]OK[/green]",
                    f"{len(m.files)} files, {_size(m.total_bytes)}",
                )
            else:
                bad += 1
                table.add_row(str(parse_step(d.name)), "[red]REJECTED[/red]", reason or "")
    console = Console()
    console.print(table)
    if not dirs:
        console.print("no checkpoint directories")
    if bad:
        raise typer.Exit(1)

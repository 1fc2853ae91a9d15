"""The supervisor's live view: a Rich progress bar plus attempt, restarts, loss and the last failure."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

__all__ = ["LiveView"]


class LiveView:
    def __init__(self, console: Console | None = None, log_dir: str | None = None) -> None:
        self.console = console or Console(stderr=True)
        if log_dir:
            self.console.print(f"[dim]worker output: {log_dir}/attempt-N/rank-R.log[/]")
        self._progress = Progress(
            TextColumn("[bold]train[/]"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=self.console,
            transient=False,
        )
        self._task = self._progress.add_task("steps", total=None, info="starting")
        self._progress.start()

    def update(self, mon: Any, restarts: int) -> None:
        loss = f"loss {mon.loss:.4f}" if mon.loss is not None else ""
        info = f"attempt {mon.attempt} · restarts {restarts} · ckpt@{max(mon.committed_step, 0)} · {loss}"
        self._progress.update(self._task, completed=max(mon.step + 1, 0), total=mon.total, info=info)

    def failure(self, cause: str, rank: int, step: int) -> None:
        self._progress.console.print(f"[red]✗ {cause}[/] on rank {rank} at step {step}: restarting")

    def close(self) -> None:
        self._progress.stop()

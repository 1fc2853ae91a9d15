"""Terminal output of ``gpufleet demo`` (rich), and the hand-off to the reliability report."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpufleet.core import events as E
from gpufleet.core.ledger import read_events

if TYPE_CHECKING:
    from gpufleet.demo.compare import Comparison
    from gpufleet.demo.config import DemoConfig, RunTiming

__all__ = ["Say", "loss_curve", "loss_summary", "report", "sample"]

_KIND_TEXT = {
    "kill": "crash (SIGKILL)",
    "hang": "hang (no heartbeat)",
    "nan": "NaN loss",
    "spike": "loss spike",
    "ckpt_corrupt": "corrupt checkpoint",
    "ckpt_fail": "failed checkpoint write",
    "slow": "slow rank",
}


class Say:
    """Prints the demo's narration; silent when there is no console."""

    def __init__(self, console: Any) -> None:
        self.c = console

    def _print(self, *a: Any, **k: Any) -> None:
        if self.c is not None:
            self.c.print(*a, **k)

    def intro(self, cfg: DemoConfig, inject: list[str]) -> None:
        if self.c is None:
            return
        from rich.panel import Panel

        lines = [
            f"Tiny character-level GPT on Shakespeare, {cfg.nproc} worker processes (gloo, CPU), "
            f"{cfg.steps} steps, seed {cfg.seed}, checkpoint every {cfg.checkpoint_every} steps.",
            "Injected into the faulted run:",
        ]
        lines += [f"  • {_KIND_TEXT.get(s.split(':')[0], s.split(':')[0])}: [cyan]{s}[/]" for s in inject]
        lines.append("The final weights must be bit-identical to the reference run's.")
        self._print(Panel("\n".join(lines), title="gpufleet demo", border_style="blue"))

    def stage(self, n: str, text: str) -> None:
        self._print(f"\n[bold blue]{n}[/] [bold]{text}[/]")

    def finished(self, r: RunTiming) -> None:
        style = "green" if r.status == "completed" else "red"
        self._print(
            f"    [{style}]{r.status}[/] in {r.wall_s:.1f} s, "
            f"{r.restarts} restart(s), exit code {r.exit_code}"
        )

    def skip_reference(self, ref_dir: Path, reusable: bool) -> None:
        if reusable:
            self._print(f"\n[bold blue]1/3[/] reference run skipped: reusing {ref_dir}")
        else:
            self._print(
                f"\n[bold blue]1/3[/] reference run skipped, and {ref_dir} holds no matching run: "
                "no exact-recovery check"
            )

    def comparison(self, c: Comparison) -> None:
        if self.c is None:
            return
        steps = {c.a.step, c.b.step}
        step = str(c.a.step) if len(steps) == 1 else f"{c.a.step} vs {c.b.step}"
        self._print(
            f"\n[bold]exact-recovery check[/]: model weights in the final checkpoints "
            f"(step {step}, {c.a.n_params:,} params)"
        )
        for label, w in (("reference", c.a), ("faulted", c.b)):
            self._print(f"  {label:<9} sha256 {w.sha256}", highlight=False, soft_wrap=True)
        if c.identical:
            self._print("[bold green]IDENTICAL[/]: bit-for-bit the same weights (max abs diff 0)")
        else:
            self._print(
                f"[bold red]DIFFERENT[/]: {len(c.mismatched)} tensor(s) differ, "
                f"max abs diff {c.max_abs_diff:.3g}"
            )

    def no_comparison(self, have_reference: bool, faulted: RunTiming) -> None:
        why = "no reference run" if not have_reference else f"the faulted run ended {faulted.status}"
        self._print(f"[yellow]exact-recovery check skipped[/]: {why}")


def loss_curve(run_dir: Path) -> list[tuple[int, float]]:
    """(step, mean loss) of the productive steps: the last record of each step wins (replays)."""
    by_step: dict[int, float] = {}
    for e in read_events(run_dir):
        if e.get("ev") == E.Step.kind and isinstance(e.get("loss"), int | float):
            by_step[int(e["step"])] = float(e["loss"])
    return sorted(by_step.items())


def _window_mean(curve: list[tuple[int, float]], first: bool, n: int = 10) -> float | None:
    pts = curve[:n] if first else curve[-n:]
    return sum(v for _, v in pts) / len(pts) if pts else None


def loss_summary(console: Any, runs: list[RunTiming]) -> None:
    if console is None:
        return
    from rich.table import Table

    t = Table(title="training loss (mean over 10 steps)", title_justify="left")
    for col in ("run", "first steps", "last steps", "wall s", "restarts"):
        t.add_column(col, justify="left" if col == "run" else "right")
    for r in runs:
        curve = loss_curve(r.run_dir)
        a, b = _window_mean(curve, True), _window_mean(curve, False)
        t.add_row(
            r.name,
            "-" if a is None else f"{a:.3f}",
            "-" if b is None else f"{b:.3f}",
            f"{r.wall_s:.1f}",
            str(r.restarts),
        )
    console.print(t)


def sample(console: Any, run_dir: Path) -> None:
    """Show the text the trained model generates (written by train_lm at the end of the run)."""
    import json

    try:
        text = json.loads((run_dir / "train_lm_summary.json").read_text()).get("sample")
    except (OSError, ValueError):
        return
    if console is None or not text:
        return
    from rich.panel import Panel
    from rich.text import Text

    console.print(Panel(Text(text.strip("\n")), title="the model writes", border_style="dim", expand=False))


def report(run_dir: Path, console: Any, plot: bool = True) -> Path | None:
    """Print the reliability report of ``run_dir`` (as ``gpufleet report`` does) and write its
    timeline PNG; returns the PNG path."""
    from gpufleet.reliability.metrics import summarize

    events = read_events(run_dir)
    summary = summarize(events, run_dir=str(run_dir))
    png: Path | None = None
    if plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            if console is not None:
                console.print(
                    "[yellow]timeline skipped[/]: matplotlib is missing (pip install 'gpufleet[plot]')"
                )
        else:
            from gpufleet.reliability.timeline import plot_timeline

            png = plot_timeline(events, run_dir / "timeline.png", title=f"gpufleet demo: {run_dir}")
            summary["timeline_png"] = str(png)
    if console is not None:
        from gpufleet.reliability.render import render

        render(summary, console)
        if png is not None:
            console.print(f"timeline: [bold]{png}[/]")
    return png

"""The Rich live view while a load runs, and the summary table printed after it.

The view is refreshed from the parent process's polling loop (no refresh thread) and the load runs
in worker processes, so drawing never delays a send.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from gpufleet.serve.bench.runner import Progress

__all__ = ["LiveView", "summary_table"]


class LiveView:
    def __init__(self, title: str, console: Console | None = None, enabled: bool = True) -> None:
        self.title = title
        self.console = console or Console(stderr=True)
        self.enabled = enabled
        self._live: Live | None = None

    def __enter__(self) -> LiveView:
        if self.enabled:
            self._live = Live(
                self._table(Progress()), console=self.console, auto_refresh=False, transient=True
            )
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(None, None, None)
            self._live = None

    def update(self, p: Progress) -> None:
        if self._live is not None:
            self._live.update(self._table(p), refresh=True)

    def _table(self, p: Progress) -> Table:
        t = Table(title=self.title, show_header=False, box=None)
        planned = f"/{p.planned}" if p.planned else ""
        rate = p.sent / p.elapsed_s if p.elapsed_s > 0 else 0.0
        t.add_row("elapsed", f"{p.elapsed_s:7.1f} s")
        t.add_row("sent", f"{p.sent}{planned}  ({rate:.1f}/s)")
        t.add_row("done", f"{p.done}   failed {p.failed}")
        t.add_row("in flight", str(p.in_flight))
        return t


def _f(x: Any, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def summary_table(s: dict[str, Any]) -> Table:
    """A compact table of one summary.json."""
    t = Table(title="gpufleet serve bench", title_justify="left")
    t.add_column("metric")
    for p in ("mean", "p50", "p90", "p95", "p99"):
        t.add_column(p, justify="right")
    for name, block in s["latency_ms"].items():
        unit = "ms"
        t.add_row(f"{name} ({unit})", *(_f(block[p]) for p in ("mean", "p50", "p90", "p95", "p99")))
    lag = s["client"]["send_lag_ms"]
    t.add_row("send lag (ms)", *(_f(lag[p], "{:.3f}") for p in ("mean", "p50", "p90", "p95", "p99")))
    r, rq, sl, tok = s["rate"], s["requests"], s["slo"], s["tokens"]
    t.add_section()
    t.add_row("requests", f"ok {rq['ok']}", f"failed {rq['failed']}", f"good {rq['good']}", "", "")
    t.add_row(
        "rate (req/s)",
        f"offered {_f(r['offered_per_s'])}",
        f"sent {_f(r['achieved_send_per_s'])}",
        f"done {_f(r['request_throughput_per_s'])}",
        "",
        "",
    )
    t.add_row("tokens", f"out {_f(tok['output_throughput_per_s'])}/s", f"source {tok['source']}", "", "", "")
    t.add_row(
        "SLO",
        f"attain {sl['attainment']:.1%}",
        f"goodput {sl['goodput_per_s']:.2f}/s",
        ",".join(f"{k}<={v:g}ms" for k, v in sl["limits_ms"].items()) or "no SLO",
        "",
        "",
    )
    if s["errors"]:
        t.add_row("errors", ", ".join(f"{k}: {v}" for k, v in s["errors"].items()), "", "", "", "")
    return t

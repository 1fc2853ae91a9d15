"""Files a benchmark writes: ``summary.json``, ``requests.csv``, ``capacity.json`` and PNG plots.

Schemas (``schema`` and ``version`` fields) are documented in docs/serve-bench.md. matplotlib is
imported only when plotting; without it the plots are skipped with a note.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpufleet.serve.bench.client import RequestRecord

__all__ = [
    "write_json",
    "write_csv",
    "plot_cdfs",
    "plot_capacity",
    "CSV_FIELDS",
    "SUMMARY_VERSION",
    "CAPACITY_VERSION",
]

SUMMARY_VERSION = 1
CAPACITY_VERSION = 1
CSV_FIELDS = (
    "index",
    "warmup",
    "intended_s",
    "sent_s",
    "lag_ms",
    "ttft_ms",
    "tpot_ms",
    "e2e_ms",
    "output_tokens",
    "prompt_tokens",
    "token_source",
    "input_tokens_asked",
    "output_tokens_asked",
    "chunks",
    "finish_reason",
    "error",
    "http_status",
    "error_detail",
)


def write_json(path: Path, obj: dict[str, Any]) -> Path:
    """Write atomically (tmp + rename): a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    os.replace(tmp, path)
    return path


def _ms(x: float | None) -> str:
    return "" if x is None else f"{x * 1000:.3f}"


def write_csv(path: Path, records: Sequence[RequestRecord]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_FIELDS)
        for r in records:
            w.writerow(
                [
                    r.index,
                    int(r.warmup),
                    f"{r.intended_s:.6f}",
                    f"{r.sent_s:.6f}",
                    _ms(r.lag_s),
                    _ms(r.ttft_s),
                    _ms(r.tpot_s),
                    _ms(r.e2e_s),
                    r.output_tokens or "",
                    r.prompt_tokens or "",
                    r.token_source,
                    r.input_tokens_asked,
                    r.output_tokens_asked,
                    r.chunks,
                    r.finish_reason,
                    r.error,
                    r.http_status or "",
                    r.error_detail,
                ]
            )
    return path


def _plt() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_cdfs(path: Path, records: Sequence[RequestRecord], title: str = "") -> Path | None:
    """Latency CDFs: TTFT, TPOT, ITL, e2e (successful, non-warm-up requests)."""
    plt = _plt()
    if plt is None:
        return None
    ok = [r for r in records if r.ok and not r.warmup]
    series = {
        "TTFT": [r.ttft_s for r in ok if r.ttft_s is not None],
        "TPOT": [t for r in ok if (t := r.tpot_s) is not None],
        "ITL": [g for r in ok for g in r.itl_s],
        "e2e": [r.e2e_s for r in ok if r.e2e_s is not None],
    }
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for ax, (name, xs) in zip(axes, series.items(), strict=True):
        xs = sorted(x * 1000 for x in xs)
        if xs:
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))])
        ax.set_title(f"{name} (n={len(xs)})")
        ax.set_xlabel("ms")
        ax.set_ylim(0, 1.01)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_capacity(path: Path, capacity: dict[str, Any]) -> Path | None:
    """Attainment and goodput against offered rate, with the target and the max rate found."""
    plt = _plt()
    if plt is None:
        return None
    pts = sorted(capacity["points"], key=lambda p: p["offered_rate"])
    xs = [p["offered_rate"] for p in pts]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.8))
    a1.plot(xs, [p["attainment"] for p in pts], "o-")
    a1.axhline(capacity["target_attainment"], color="r", ls="--", label="target")
    a1.set_ylabel("SLO attainment")
    a2.plot(xs, [p["goodput_per_s"] for p in pts], "o-", label="goodput")
    a2.plot(xs, [p["achieved_rate"] or 0 for p in pts], "x:", label="throughput")
    a2.set_ylabel("requests/s")
    for ax in (a1, a2):
        ax.set_xlabel("offered rate (req/s)")
        if capacity.get("max_rate"):
            ax.axvline(capacity["max_rate"], color="g", ls=":", label="max rate")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

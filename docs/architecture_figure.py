"""Draws docs/architecture.svg: the import layers (left) and the event flow (right).

    .venv/bin/python docs/architecture_figure.py [--out docs/architecture.svg]

Needs matplotlib (the ``plot`` extra). The output is deterministic (no date, fixed ids), so a rerun
on unchanged input leaves git clean.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

# name, contents, colour (lowest layer last)
LAYERS = [
    (
        "cli/",
        "one thin module per command group:\nflags -> typed request -> library call -> render",
        "#d9e2f3",
    ),
    (
        "gpufleet  ·  demo/",
        "the public API (init, Run, StepSampler, errors)\nand the demo, a user of it",
        "#e2efd9",
    ),
    (
        "train/  ·  backends/",
        "Run, supervisor, faults, rollback, loader state\nBackend + Attempt: local; slurm/, k8s/, ray/",
        "#fff2cc",
    ),
    (
        "checkpoint/  health/  reliability/  serve/",
        "domain packages; may use each other one way, never upward\n(compress/, observe/, fleet/ join here)",
        "#fbe5d6",
    ),
    ("core/", "errors, typed events, ledger, settings,\nunits (parse_duration), exit codes", "#ededed"),
]

FLOW = [  # label, detail
    ("worker ranks", "gpufleet.init() -> Run:\nsteps, loss, heartbeats;\ncheckpoint engine"),
    ("supervisor", "agent per node (backend);\nhang / crash / spike\ndetection, restarts"),
    ("ledger", "RUN_DIR/ledger.jsonl: one\ntyped event per line (core.events),\nversioned, append-only"),
    ("walker", "reliability.walk: sessions,\nsteps, incidents"),
    ("report · metrics", "MTBF, MTTR, goodput;\ngpufleet report, plots,\nPrometheus (observe/)"),
]


def box(ax, x, y, w, h, title, body, color, title_size=10.5):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.01,rounding_size=0.02",
                                fc=color, ec="#555555", lw=1.0))  # fmt: skip
    ax.text(x + 0.02, y + h - 0.025, title, ha="left", va="top", fontsize=title_size, weight="bold",
            family="monospace")  # fmt: skip
    ax.text(x + 0.02, y + h - 0.075, body, ha="left", va="top", fontsize=8.5, linespacing=1.35)


def arrow(ax, a, b, text="", style="-|>", color="#333333", text_xy=None):
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle=style, mutation_scale=14, color=color, lw=1.3))
    if text:
        tx, ty = text_xy or ((a[0] + b[0]) / 2, (a[1] + b[1]) / 2)
        ax.text(tx, ty, text, ha="center", va="center", fontsize=7.5, color=color, style="italic",
                bbox={"fc": "white", "ec": "none", "pad": 1.0})  # fmt: skip


def draw(out: Path) -> None:
    plt.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "gpufleet-architecture",
                         "font.family": "DejaVu Sans"})  # fmt: skip
    fig = plt.figure(figsize=(13.5, 7.2))

    # -- layers
    ax = fig.add_axes((0.0, 0.0, 0.46, 1.0))
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.axis("off")
    ax.text(0.08, 0.975, "Layers: imports point down only", fontsize=12.5, weight="bold", va="top")
    h, gap, top = 0.14, 0.04, 0.93
    for i, (name, body, color) in enumerate(LAYERS):
        y = top - (i + 1) * h - i * gap
        box(ax, 0.08, y, 0.9, h, name, body, color)
        if i < len(LAYERS) - 1:
            arrow(ax, (0.53, y), (0.53, y - gap), style="-|>")
    arrow(ax, (0.035, top - 0.02), (0.035, top - len(LAYERS) * (h + gap) + gap + 0.02), style="-|>",
          text="imports", text_xy=(0.035, 0.5))  # fmt: skip
    ax.text(0.08, 0.02, "tests/unit/test_layering.py enforces this, and no import cycles",
            fontsize=8, color="#555555")  # fmt: skip

    # -- event flow
    ax = fig.add_axes((0.48, 0.0, 0.52, 1.0))
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.axis("off")
    ax.text(0.02, 0.975, "Event flow: the ledger is the one source of the numbers", fontsize=12.5,
            weight="bold", va="top")  # fmt: skip
    w, bh = 0.42, 0.15
    xs = [0.02, 0.52, 0.52, 0.52, 0.02]
    ys = [0.73, 0.73, 0.50, 0.27, 0.27]
    colors = ["#fff2cc", "#fff2cc", "#ededed", "#fbe5d6", "#fbe5d6"]
    for (label, detail), x, y, c in zip(FLOW, xs, ys, colors, strict=True):
        box(ax, x, y, w, bh, label, detail, c)
    arrow(ax, (0.44, 0.80), (0.52, 0.80), "pipe / srun\nstdout", text_xy=(0.48, 0.915))
    arrow(ax, (0.73, 0.73), (0.73, 0.65), "append", text_xy=(0.81, 0.69))
    arrow(ax, (0.73, 0.50), (0.73, 0.42), "read, type", text_xy=(0.82, 0.46))
    arrow(ax, (0.52, 0.345), (0.44, 0.345))
    # a worker running standalone writes its ledger itself
    arrow(ax, (0.23, 0.73), (0.52, 0.575), "standalone: rank 0\nwrites the ledger", color="#777777",
          text_xy=(0.25, 0.60))  # fmt: skip
    # extension points
    ext = [
        "Extension points",
        "backends: Backend.start -> Attempt (poll, request_final_checkpoint, stop, events),",
        "     after_failure -> Verdict; registry in backends/__init__; one subpackage per platform",
        "health: @register(name, component=...) checks by family; plans, GPU profiles: health/data/*.toml",
        "storage: the checkpoint tiers, checkpoint/storage/{local, memory, peer, s3}",
        "serve: latency profiles (serve/plan/data/profiles/*.json, or fitted by serve profile)",
    ]
    ax.text(0.02, 0.215, ext[0], fontsize=10, weight="bold", va="top")
    ax.text(0.02, 0.18, "\n".join(ext[1:]), fontsize=8.3, va="top", linespacing=1.45)

    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, metadata={"Date": None, "Creator": None})
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "architecture.svg")
    args = ap.parse_args()
    draw(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""A PNG timeline of a run: progress (step) against wall time, failures, checkpoints, restores.

matplotlib is imported inside :func:`plot_timeline` with the Agg backend, so importing this module
is cheap and it works without a display. Sessions are laid end to end (the gaps between them are
cut out), with a dashed line where each new session starts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from gpufleet.core import events as E
from gpufleet.reliability.metrics import BADPUT_CATEGORIES, Events, badput
from gpufleet.reliability.walk import walk

__all__ = ["plot_timeline", "CAUSE_COLORS"]

CAUSE_COLORS = {
    E.FailureCause.CRASH: "#d62728",
    E.FailureCause.HANG: "#ff7f0e",
    E.FailureCause.SPIKE: "#9467bd",
}
_BADPUT_COLORS = {
    "productive": "#2ca02c",
    "ckpt_stall": "#17becf",
    "detect": "#ff7f0e",
    "teardown": "#d62728",
    "spawn_init": "#bcbd22",
    "load": "#1f77b4",
    "recompute": "#9467bd",
    "idle": "#c7c7c7",
}
_ATTEMPT_COLORS = ("#1f77b4", "#2ca02c", "#17becf", "#8c564b", "#7f7f7f", "#bcbd22")


def plot_timeline(events: Events, path: str | os.PathLike[str], title: str = "") -> Path:
    """Draw the timeline of ``events`` into the PNG ``path``; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    evs = list(events)
    w = walk(evs)
    offsets: dict[int, float] = {}
    acc = 0.0
    for s in w.sessions:
        offsets[s.index] = acc - s.start
        acc += s.wall

    def x(t: float, si: int) -> float:
        return t + offsets.get(si, 0.0)

    fig = plt.figure(figsize=(11, 6.2), dpi=110)
    gs = fig.add_gridspec(2, 1, height_ratios=[5, 1], hspace=0.45)
    ax = fig.add_subplot(gs[0])
    axb = fig.add_subplot(gs[1])

    # progress per attempt: steps completed (step index + 1) against run time
    runs: dict[tuple[int, int], list[Any]] = {}
    for ex in w.steps:
        runs.setdefault((ex.session, ex.attempt), []).append(ex)
    for n, ((si, _att), exs) in enumerate(sorted(runs.items())):
        color = _ATTEMPT_COLORS[n % len(_ATTEMPT_COLORS)]
        xs = [x(e.start, si) for e in exs[:1]] + [x(e.t, si) for e in exs]
        ys = [exs[0].step] + [e.step + 1 for e in exs]
        ax.plot(xs, ys, color=color, lw=1.8, drawstyle="default", zorder=3)
        # rolled-back work: a wide translucent red band under the line (and x marks when few)
        seg: list[Any] = []
        for e in [*exs, None]:
            if e is not None and e.wasted:
                seg.append(e)
                continue
            if seg:
                sx = [x(seg[0].start, si)] + [x(q.t, si) for q in seg]
                sy = [seg[0].step] + [q.step + 1 for q in seg]
                ax.plot(sx, sy, color="#d62728", lw=7, alpha=0.3, solid_capstyle="butt", zorder=2)
                if len(seg) <= 60:
                    ax.plot(sx[1:], sy[1:], ls="none", marker="x", ms=4, color="#d62728", zorder=4)
                seg = []
    ymax = max((e.step + 1 for e in w.steps), default=1)

    # start-up spans (session start -> its first step began) and recovery spans, failure markers
    for s in w.sessions:
        first = next((e for e in w.steps if e.session == s.index), None)
        if first is not None and first.start > s.start:
            ax.axvspan(x(s.start, s.index), x(first.start, s.index), color="#e8e8c0", alpha=0.6, lw=0)
    for inc in w.incidents:
        end = inc.t_first_step if inc.t_first_step is not None else inc.t_end
        if end is not None:
            ax.axvspan(x(inc.t_happen, inc.session), x(end, inc.session), color="#f2c4c4", alpha=0.6, lw=0)
        ax.axvline(x(inc.t_detect, inc.session), color=CAUSE_COLORS.get(inc.cause, "k"), lw=1.6, zorder=2)
        ax.annotate(
            inc.cause,
            (x(inc.t_detect, inc.session), ymax * 1.04),
            xytext=(3, 0),
            textcoords="offset points",
            color=CAUSE_COLORS.get(inc.cause, "k"),
            fontsize=8,
            ha="left",
            va="bottom",
            annotation_clip=False,
        )

    # checkpoint commits (ticks at the committed step) and restores (circles at the resume step)
    def session_at(t: float) -> int:
        si = 0
        for s in w.sessions:
            if t >= s.start:
                si = s.index
        return si

    cx = [(e.t, e.step) for e in w.events(E.CkptCommitted)]
    if cx:
        ax.plot([x(t, session_at(t)) for t, _ in cx], [s for _, s in cx], ls="none", marker="v", ms=7,
                color="#2ca02c", markeredgecolor="k", mew=0.5, zorder=5)  # fmt: skip
    fx = [e.t for e in w.events(E.CkptFailed)]
    if fx:
        ax.plot(
            [x(t, session_at(t)) for t in fx], [0] * len(fx), ls="none", marker="X", ms=8, color="#d62728"
        )
    rx = [(e.t, e.step) for e in w.restores]
    if rx:
        ax.plot([x(t, session_at(t)) for t, _ in rx], [s for _, s in rx], ls="none", marker="o", ms=7,
                mfc="white", color="#1f77b4", mew=1.5, zorder=5)  # fmt: skip
    for s in w.sessions[1:]:
        ax.axvline(x(s.start, s.index), color="k", ls="--", lw=1)
    for e in w.events(E.Restart):
        ax.axvline(x(e.t, session_at(e.t)), color="#555555", ls=":", lw=1)

    ax.set_xlim(0, max(acc, 1e-9))
    ax.set_ylim(0, ymax * 1.08 + 1)
    ax.set_xlabel("run wall time (s)" + (", sessions end to end" if len(w.sessions) > 1 else ""))
    ax.set_ylabel("steps completed")
    ax.grid(alpha=0.3)
    handles: list[Any] = [
        Line2D([], [], color=_ATTEMPT_COLORS[0], lw=1.8, label="progress (one color per attempt)"),
        Line2D([], [], color="#d62728", lw=7, alpha=0.3, label="rolled back (recomputed)"),
        Line2D([], [], ls="none", marker="v", color="#2ca02c", mec="k", label="checkpoint committed"),
        Line2D([], [], ls="none", marker="o", mfc="white", color="#1f77b4", label="restore (resume step)"),
        Patch(color="#f2c4c4", label="recovery (failure → first step)"),
        Patch(color="#e8e8c0", label="start-up (spawn, init, load)"),
        Line2D([], [], color="#555555", ls=":", label="restart"),
    ]
    if fx:
        handles.append(Line2D([], [], ls="none", marker="X", color="#d62728", label="checkpoint failed"))
    if len(w.sessions) > 1:
        handles.append(Line2D([], [], color="k", ls="--", lw=1, label="new session (gap cut out)"))
    for c in sorted({i.cause for i in w.incidents}):
        handles.append(Line2D([], [], color=CAUSE_COLORS.get(c, "k"), lw=1.6, label=f"failure: {c}"))
    ax.legend(handles=handles, loc="upper left", fontsize=8, framealpha=0.9)
    # badput breakdown: one stacked horizontal bar of the wall time
    bp = badput(w)
    wall = sum(bp.values())
    gp = f"goodput {100 * bp['productive'] / wall:.1f}%" if wall > 0 else "no wall time"
    stats = f"{gp}, {len(w.failures)} failures, {len(w.sessions)} session(s)"
    ax.set_title(f"{title or 'gpufleet run timeline'}  ({stats})", loc="left", fontsize=11)
    left = 0.0
    for k in ("productive", *BADPUT_CATEGORIES):
        v = bp.get(k, 0.0)
        if v <= 0.0:
            continue
        axb.barh(
            0, v, left=left, color=_BADPUT_COLORS[k], edgecolor="white", label=f"{k} {100 * v / wall:.1f}%"
        )
        left += v
    axb.set_xlim(0, max(wall, 1e-9))
    axb.set_yticks([])
    axb.set_xlabel("wall time (s): where it went")
    if left > 0.0:
        axb.legend(loc="upper center", bbox_to_anchor=(0.5, -0.55), ncol=4, fontsize=8, frameon=False)

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, bbox_inches="tight")
    plt.close(fig)
    return out

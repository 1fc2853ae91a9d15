"""Straggler detection during training: a rank slower than its peers slows every step of the job.

Each rank sends, with its per-step ``sync`` heartbeat, two timings of the step it just ran
(:class:`~gpufleet.core.events.TimingSection`):

- ``fwd``: from the step's start to the end of the model's first forward (data loading and forward).
  Under DDP the gradient all-reduce in the backward makes every rank wait for the slowest, so the
  whole step takes the same time on every rank; the part before the first collective does not.
- ``work``: from the step's start to the per-step control all-reduce, less the checkpoint stall. It
  shows a slow rank in scripts that synchronise only at the end of the step.

The supervisor collects them per window of steps and compares each rank's median with its peers'
with the rule of ``health``'s peer check (:mod:`gpufleet.health.relative`): slower than the peers'
median by at least ``min_ratio``, *and* by ``k`` scaled median absolute deviations of the peers, *and*
by ``min_excess_s`` (so sub-millisecond sections do not flag noise). A rank slow in ``windows``
consecutive windows is a straggler: one ``straggler`` ledger event per rank and section per attempt.
Medians over a window, not single steps, so a rank that the OS delays now and then is not flagged.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field

from gpufleet.core import events as E
from gpufleet.health.relative import MAD_SCALE, mad

__all__ = ["StragglerConfig", "StragglerDetector"]


@dataclass(kw_only=True, slots=True)
class StragglerConfig:
    """When a rank counts as a straggler."""

    window: int = 20
    """Steps per window; a rank's figure for a window is its median over those steps."""
    min_ratio: float = 1.5
    """Slower than the peers' median by at least this factor."""
    k: float = 3.0
    """... and by at least ``k`` scaled median absolute deviations of the peers' medians."""
    min_excess_s: float = 0.005
    """... and by at least this many seconds."""
    windows: int = 3
    """Consecutive slow windows before the rank is flagged."""


@dataclass(slots=True)
class StragglerDetector:
    """Feed it every rank's ``sync`` heartbeat timings; it returns the straggler events to record."""

    ranks: list[int]
    config: StragglerConfig = field(default_factory=StragglerConfig)
    # window index -> section -> rank -> that rank's values in the window
    _open: dict[int, dict[E.TimingSection, dict[int, list[float]]]] = field(default_factory=dict)
    _slow: dict[tuple[int, E.TimingSection], int] = field(default_factory=lambda: defaultdict(int))
    _flagged: set[tuple[int, E.TimingSection]] = field(default_factory=set)

    def observe(self, rank: int, step: int, work: float | None, fwd: float | None) -> list[E.Straggler]:
        if len(self.ranks) < 2:
            return []
        w = step // self.config.window
        sections = self._open.setdefault(w, {})
        for section, value in ((E.TimingSection.WORK, work), (E.TimingSection.FWD, fwd)):
            if value is not None:
                sections.setdefault(section, {}).setdefault(rank, []).append(value)
        work_samples = sections.get(E.TimingSection.WORK, {})
        if not all(len(work_samples.get(r, ())) >= self.config.window for r in self.ranks):
            return []
        del self._open[w]
        for old in [k for k in self._open if k < w]:  # windows a rank never finished (it died, or a skip)
            del self._open[old]
        return self._judge(sections, step)

    def _judge(self, sections: dict[E.TimingSection, dict[int, list[float]]], step: int) -> list[E.Straggler]:
        cfg = self.config
        found: list[E.Straggler] = []
        for section, values in sections.items():
            if any(len(values.get(r, ())) < cfg.window // 2 for r in self.ranks):
                continue  # a section not every rank timed (no forward hook on some rank): not comparable
            meds = {r: statistics.median(values[r]) for r in self.ranks}
            for r in self.ranks:
                peers = [meds[q] for q in self.ranks if q != r]
                peer_med = statistics.median(peers)
                spread = MAD_SCALE * mad(peers) if len(peers) > 1 else 0.0
                cut = max(cfg.min_ratio * peer_med, peer_med + cfg.k * spread, peer_med + cfg.min_excess_s)
                key = (r, section)
                self._slow[key] = self._slow[key] + 1 if meds[r] > cut else 0
                if self._slow[key] >= cfg.windows and key not in self._flagged:
                    self._flagged.add(key)
                    found.append(
                        E.Straggler(
                            rank=r,
                            step=step,
                            section=section,
                            seconds=round(meds[r], 6),
                            peers_s=round(peer_med, 6),
                            ratio=round(meds[r] / max(peer_med, 1e-9), 3),
                            windows=self._slow[key],
                        )
                    )
        return found

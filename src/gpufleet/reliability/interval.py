"""Checkpoint interval policy: fixed steps, fixed seconds, or ``auto`` (Young/Daly, recomputed online).

Used inside training ranks, so it imports nothing heavy (no torch, no numpy).

Formulas (δ = blocking checkpoint cost, M = mean time between failures, both in seconds):

* Young (1974):  τ = √(2δM)
* Daly (2004):   τ = √(2δM)·[1 + ⅓·√(δ/2M) + (δ/2M)/9] − δ   when δ < 2M, else τ = M

``auto`` takes δ from the measured stalls (median of the recent ones) plus the interference of the
background persist (steps that overlap a persist run slower when its threads take CPU from
training: (median overlapped step − median clean step) × the steps one persist spans), M from the
run directory's ledger history (:func:`gpufleet.reliability.metrics.mtbf_history`) or a configured
value, computes Daly's τ, raises it to at least ``persist_margin`` × the measured persist time
(async saves: at most one in flight, so a save must have finished persisting before the next one is
due) and to at least one step, then converts it to steps with the measured median step time (stall
excluded).

Until a stall has been measured, ``auto`` bootstraps: the first checkpoint is taken after
``bootstrap_steps`` steps (default 5) to measure δ; from then on the Daly interval applies.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from gpufleet.core.errors import ConfigError
from gpufleet.core.units import parse_interval

__all__ = [
    "IntervalPolicy",
    "young",
    "daly",
    "expected_goodput",
    "optimal_goodput",
    "DEFAULT_MTBF_S",
    "BOOTSTRAP_STEPS",
]

DEFAULT_MTBF_S = 6 * 3600.0
"""MTBF assumed by ``auto`` when neither the ledger history nor the user gives one (6 h)."""

BOOTSTRAP_STEPS = 5
"""``auto`` takes its first checkpoint after this many steps, to measure the stall δ."""


def young(delta: float, mtbf: float) -> float:
    """Young's first-order optimum checkpoint interval τ = √(2δM), seconds."""
    return math.sqrt(2.0 * max(delta, 0.0) * max(mtbf, 0.0))


def daly(delta: float, mtbf: float) -> float:
    """Daly's higher-order optimum interval (compute time between checkpoints), seconds."""
    d, m = max(delta, 0.0), max(mtbf, 0.0)
    if m <= 0.0:
        return 0.0
    if d >= 2.0 * m:
        return m
    x = d / (2.0 * m)
    return math.sqrt(2.0 * d * m) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - d


def expected_goodput(
    tau: float, delta: float, mtbf: float, restart_s: float = 0.0, *, persist_s: float = 0.0
) -> float:
    """First-order expected goodput with a checkpoint every ``tau`` seconds of work.

    Fraction of wall time lost ≈ δ/τ (stalls) + (τ/2 + p + R)/M (per failure: on average half an
    interval of work, plus the persist time p of the checkpoint still in flight, plus the restart
    time R, one failure every M seconds). Goodput = 1 − loss, clamped to [0, 1].
    """
    if tau <= 0.0:
        return 0.0 if delta > 0.0 else max(0.0, 1.0 - (persist_s + restart_s) / mtbf)
    lost = delta / tau + (tau / 2.0 + persist_s + restart_s) / mtbf
    return min(1.0, max(0.0, 1.0 - lost))


def optimal_goodput(
    delta: float, mtbf: float, restart_s: float = 0.0, *, persist_s: float = 0.0, min_tau: float = 0.0
) -> float:
    """Young–Daly analytic goodput at the optimum interval (first-order model, see ``expected_goodput``).

    τ* = √(2δM) minimises δ/τ + τ/2M, giving loss* = √(2δ/M) + (p + R)/M. With asynchronous saves
    τ cannot be shorter than the persist time (nor than ``min_tau``, e.g. one step), so τ is raised
    to ``max(τ*, persist_s, min_tau)``. The P4 benchmark compares measured goodput with this value.
    """
    if mtbf <= 0.0:
        return 0.0
    tau = max(young(delta, mtbf), persist_s, min_tau)
    return expected_goodput(tau, delta, mtbf, restart_s, persist_s=persist_s)


def _median(xs: deque[float] | list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    mid = n // 2
    return s[mid] if n % 2 else (s[mid - 1] + s[mid]) / 2.0


@dataclass
class IntervalPolicy:
    """When to checkpoint. Build one with :meth:`parse`.

    ``step`` arguments are step boundaries: the number of steps completed so far, which is also the
    step a checkpoint taken there resumes at. ``now`` is any monotonic clock in seconds.
    """

    mode: str  # "steps" | "time" | "auto"
    every_steps: int | None = None
    every_s: float | None = None
    mtbf_s: float | None = None
    bootstrap_steps: int = BOOTSTRAP_STEPS
    persist_margin: float = 1.25
    change_threshold: float = 0.1  # relative change in every_steps that counts as material
    window: int = 9  # recent stalls / persist times in the robust average
    spec: str = ""
    mtbf_source: str = "configured"  # where mtbf_s came from: "history" | "configured"
    delta_s: float | None = field(default=None, init=False)
    interference_s: float = field(default=0.0, init=False)
    persist_s: float | None = field(default=None, init=False)
    step_s: float | None = field(default=None, init=False)
    tau_s: float | None = field(default=None, init=False)
    _stalls: deque[float] = field(default_factory=deque, init=False, repr=False)
    _persists: deque[float] = field(default_factory=deque, init=False, repr=False)
    _steps: deque[float] = field(default_factory=lambda: deque(maxlen=32), init=False, repr=False)
    _clean: deque[float] = field(default_factory=lambda: deque(maxlen=32), init=False, repr=False)
    _overlapped: deque[float] = field(default_factory=lambda: deque(maxlen=32), init=False, repr=False)
    _last_step: int | None = field(default=None, init=False, repr=False)
    _last_t: float | None = field(default=None, init=False, repr=False)
    _decided_steps: int | None = field(default=None, init=False, repr=False)

    @classmethod
    def parse(
        cls, spec: str, *, mtbf_s: float | None = None, mtbf_source: str = "configured"
    ) -> IntervalPolicy:
        """``"100"``/``"100steps"`` | ``"90s"``/``"5m"``/``"1h"`` | ``"auto"``; else ConfigError.

        ``mtbf_s`` is M for ``auto`` (from ``mtbf_history`` or the user); None means DEFAULT_MTBF_S.
        """
        if mtbf_s is not None and not (mtbf_s > 0.0 and math.isfinite(mtbf_s)):
            raise ConfigError(f"invalid MTBF {mtbf_s!r} for the checkpoint interval: must be > 0 seconds")
        iv = parse_interval(spec)
        return cls(
            mode=iv.mode,
            every_steps=iv.every_steps,
            every_s=iv.every_s,
            mtbf_s=mtbf_s,
            spec=iv.spec,
            mtbf_source=mtbf_source if iv.mode == "auto" else "configured",
        )

    # -- scheduling -------------------------------------------------------------------------------

    def reset(self, step: int, now: float) -> None:
        """Start counting from ``step`` (the resume step); called implicitly by the first ``due``."""
        self._last_step, self._last_t = step, now

    def due(self, step: int, now: float) -> bool:
        """Should a checkpoint be taken at this step boundary?"""
        if self._last_step is None or self._last_t is None:
            self.reset(step, now)
            return False
        since = step - self._last_step
        if since < 1:
            return False
        if self.mode == "time":
            assert self.every_s is not None
            return now - self._last_t >= self.every_s
        return since >= self.current_every_steps()

    def saved(self, step: int, now: float) -> None:
        """A save was started at this step boundary."""
        self._last_step, self._last_t = step, now

    def current_every_steps(self) -> int:
        """The interval in steps now in force (steps and auto modes)."""
        if self.mode == "steps":
            assert self.every_steps is not None
            return self.every_steps
        if self.mode == "auto" and self._decided_steps is not None:
            return self._decided_steps
        return max(1, self.bootstrap_steps)

    # -- auto -------------------------------------------------------------------------------------

    def set_mtbf(self, mtbf_s: float | None) -> dict[str, Any] | None:
        """Change M (e.g. after the history grew); returns a decision if τ changed materially."""
        self.mtbf_s = mtbf_s
        return self._recompute()

    def observe(
        self,
        *,
        stall_s: float | None = None,
        step_s: float | None = None,
        persist_s: float | None = None,
        overlapped: bool | None = None,
    ) -> dict[str, Any] | None:
        """Feed measurements (a checkpoint's stall, a step's time without stall, a persist time;
        ``overlapped``: whether that step ran while a save persisted in the background).

        In ``auto`` mode τ is recomputed; returns the decision (fields of an ``interval`` event) when
        ``every_steps`` changed materially, else None. Fixed policies always return None.
        """
        if stall_s is not None and stall_s >= 0.0 and math.isfinite(stall_s):
            self._push(self._stalls, stall_s)
            self.delta_s = _median(self._stalls)
        if persist_s is not None and persist_s >= 0.0 and math.isfinite(persist_s):
            self._push(self._persists, persist_s)
            self.persist_s = _median(self._persists)
        if step_s is not None and step_s > 0.0 and math.isfinite(step_s):
            self._steps.append(step_s)
            self.step_s = _median(self._steps)
            if overlapped is not None:
                (self._overlapped if overlapped else self._clean).append(step_s)
        self.interference_s = self._interference()
        return self._recompute()

    def _interference(self) -> float:
        """Training time one background persist costs: the extra time of the steps it overlaps."""
        if len(self._clean) < 3 or len(self._overlapped) < 3 or not self.persist_s:
            return 0.0
        clean, slow = _median(self._clean), _median(self._overlapped)
        return max(0.0, slow - clean) * self.persist_s / slow

    def _push(self, q: deque[float], x: float) -> None:
        q.append(x)
        while len(q) > self.window:
            q.popleft()

    def _recompute(self) -> dict[str, Any] | None:
        if self.mode != "auto" or self.delta_s is None or self.step_s is None:
            return None
        mtbf = self.mtbf_s if self.mtbf_s is not None else DEFAULT_MTBF_S
        tau = daly(self.delta_s + self.interference_s, mtbf)
        if self.persist_s is not None:
            tau = max(tau, self.persist_margin * self.persist_s)
        tau = max(tau, self.step_s)
        self.tau_s = tau
        steps = max(1, round(tau / self.step_s))
        old = self._decided_steps
        if old is not None and abs(steps - old) <= max(0.0, self.change_threshold * old):
            return None
        self._decided_steps = steps
        return self.decision()

    def decision(self) -> dict[str, Any]:
        """The policy now in force, as the fields of an ``interval`` ledger event."""
        if self.mode == "auto":
            mtbf = self.mtbf_s if self.mtbf_s is not None else DEFAULT_MTBF_S
            return {
                "policy": "auto",
                "model": "daly" if self._decided_steps is not None else "bootstrap",
                "every_steps": self.current_every_steps(),
                "every_s": self.tau_s,
                "delta_s": self.delta_s,
                "interference_s": self.interference_s,
                "mtbf_s": mtbf,
                "mtbf_source": self.mtbf_source if self.mtbf_s is not None else "default",
                "persist_s": self.persist_s,
                "step_s": self.step_s,
            }
        return {
            "policy": self.mode,
            "every_steps": self.every_steps,
            "every_s": self.every_s,
            "delta_s": self.delta_s,
            "mtbf_s": self.mtbf_s,
            "persist_s": self.persist_s,
        }

"""Arrival processes: the intended send offsets (seconds from the start) of an open-loop load.

``poisson`` (exponential gaps), ``constant`` (gap 1/rate) and ``gamma:<shape>`` (gamma gaps with
mean 1/rate; shape < 1 is burstier than Poisson, > 1 smoother; shape 1 is Poisson). Seeded, so a
run's schedule is reproducible.
"""

from __future__ import annotations

import enum
import math
import random
from dataclasses import dataclass

from gpufleet.core.errors import UsageError

__all__ = ["Arrival", "ArrivalKind", "parse_arrival", "schedule"]


class ArrivalKind(enum.StrEnum):
    POISSON = "poisson"  # exponential gaps
    CONSTANT = "constant"  # gap 1/rate
    GAMMA = "gamma"  # gamma gaps of mean 1/rate and the given shape


@dataclass(frozen=True)
class Arrival:
    kind: ArrivalKind
    shape: float = 1.0

    def __str__(self) -> str:
        return f"gamma:{self.shape:g}" if self.kind == ArrivalKind.GAMMA else str(self.kind)

    def gap(self, rng: random.Random, rate: float) -> float:
        if self.kind == ArrivalKind.CONSTANT:
            return 1.0 / rate
        if self.kind == ArrivalKind.POISSON:
            return rng.expovariate(rate)
        return rng.gammavariate(self.shape, 1.0 / (self.shape * rate))


def parse_arrival(text: str) -> Arrival:
    kind, _, arg = text.strip().lower().partition(":")
    if kind in (ArrivalKind.POISSON, ArrivalKind.CONSTANT) and not arg:
        return Arrival(ArrivalKind(kind))
    if kind == ArrivalKind.GAMMA:
        try:
            shape = float(arg)
        except ValueError:
            raise UsageError(f"--arrival gamma needs a shape, e.g. gamma:0.5 (got {text!r})") from None
        if not math.isfinite(shape) or shape <= 0:
            raise UsageError(f"--arrival gamma shape must be > 0 (got {text!r})")
        return Arrival(ArrivalKind.GAMMA, shape)
    raise UsageError(f"unknown --arrival {text!r} (choose poisson, constant, gamma:<shape>)")


def schedule(
    arrival: Arrival, rate: float, *, count: int | None = None, duration_s: float | None = None, seed: int = 0
) -> list[float]:
    """Send offsets: ``count`` of them, or all that fall before ``duration_s``. The first is at 0."""
    if not (math.isfinite(rate) and rate > 0):
        raise UsageError(f"--rate must be > 0 (got {rate:g})")
    if count is None and duration_s is None:
        raise ValueError("schedule needs count or duration_s")
    rng = random.Random(seed)
    out: list[float] = []
    t = 0.0
    while True:
        if count is not None and len(out) >= count:
            break
        if duration_s is not None and t >= duration_s:
            break
        out.append(t)
        t += arrival.gap(rng, rate)
    return out

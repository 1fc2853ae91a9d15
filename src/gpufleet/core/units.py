"""Units that flags, settings and specs share: one duration grammar and one checkpoint-interval grammar.

Durations are a number and a unit: ``150us``, ``200ms``, ``0.5s``/``12sec``, ``2m``/``2min``, ``1h``/``1hr``.
A bare number is seconds unless the caller requires a unit (an SLO, where ``500`` would be ambiguous,
and the checkpoint interval, where a bare number counts steps). Every error is one-line ConfigError.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal

from gpufleet.core.errors import ConfigError

__all__ = ["DURATION_UNITS", "INTERVAL_FORMS", "parse_duration", "CheckpointInterval", "parse_interval"]

DURATION_UNITS: dict[str, float] = {
    "us": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "sec": 1.0,
    "m": 60.0,
    "min": 60.0,
    "h": 3600.0,
    "hr": 3600.0,
}
_DURATION = re.compile(r"^([0-9]*\.?[0-9]+(?:e[-+]?[0-9]+)?)\s*(us|ms|sec|s|min|m|hr|h)?$")
_EXAMPLES = "e.g. 200ms, 0.5s, 150us, 2m, 1h"


def parse_duration(
    value: str | float, what: str = "duration", *, unit_required: bool = False, allow_zero: bool = True
) -> float:
    """``"200ms"``, ``"0.5s"``, ``"150us"``, ``"2m"``, ``"1h"`` or a bare number of seconds -> seconds.

    ``what`` names the flag or key in the error. ``unit_required``: a bare number is an error.
    ``allow_zero=False``: the duration must be > 0 (else >= 0). Negative, NaN and infinite values fail.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{what}: {value!r} is not a duration ({_EXAMPLES})")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        m = _DURATION.match(value.strip().lower())
        if not m or (unit_required and m.group(2) is None):
            need = " with a unit" if unit_required else ""
            raise ConfigError(f"{what}: {value!r} is not a duration{need} ({_EXAMPLES})")
        seconds = float(m.group(1)) * DURATION_UNITS[m.group(2) or "s"]
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{what}: {value!r} must be a finite duration {bound}")
    return seconds


_STEPS = re.compile(r"^(\d+)\s*(?:steps?)?$")
INTERVAL_FORMS = "valid forms: N or Nsteps (every N steps), 90s / 5m / 1h (every so much time), auto"


@dataclass(frozen=True)
class CheckpointInterval:
    """A parsed ``--checkpoint-every``: every N steps, every so many seconds, or ``auto`` (Young/Daly)."""

    mode: Literal["steps", "time", "auto"]
    every_steps: int | None = None
    every_s: float | None = None
    spec: str = "auto"


def parse_interval(spec: str | int) -> CheckpointInterval:
    """``"100"``/``"100steps"`` | ``"90s"``/``"5m"``/``"1h"`` | ``"auto"``; else a one-line ConfigError."""
    s = str(spec).strip().lower()
    if s == "auto":
        return CheckpointInterval("auto", spec=s)
    m = _STEPS.match(s)
    if m:
        if int(m.group(1)) > 0:
            return CheckpointInterval("steps", every_steps=int(m.group(1)), spec=s)
    else:
        try:
            secs = parse_duration(s, "checkpoint interval", unit_required=True, allow_zero=False)
        except ConfigError:
            pass
        else:
            return CheckpointInterval("time", every_s=secs, spec=s)
    raise ConfigError(f"invalid checkpoint interval {spec!r}: {INTERVAL_FORMS}")

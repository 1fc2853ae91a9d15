"""SLO strings: ``ttft=500ms,tpot=50ms,e2e=10s`` → limits in seconds, checked per request."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from gpufleet.core.errors import UsageError

__all__ = ["SLO", "parse_duration", "parse_slo"]

_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}
_DUR = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(us|ms|s|m)\s*$")
KEYS = ("ttft", "tpot", "e2e")


def parse_duration(text: str, what: str = "duration") -> float:
    """``500ms``, ``0.5s``, ``200us``, ``2m`` → seconds (> 0). A unit is required."""
    m = _DUR.match(text)
    if not m:
        raise UsageError(f"{what}: {text!r} is not a duration with a unit (e.g. 500ms, 2s, 200us)")
    v = float(m.group(1)) * _UNITS[m.group(2)]
    if not math.isfinite(v) or v <= 0:
        raise UsageError(f"{what}: {text!r} must be > 0")
    return v


@dataclass(frozen=True)
class SLO:
    """Limits in seconds; ``None`` means not part of the SLO."""

    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None

    def __bool__(self) -> bool:
        return any(v is not None for v in (self.ttft, self.tpot, self.e2e))

    def as_dict(self) -> dict[str, float]:
        return {k: v for k in KEYS if (v := getattr(self, k)) is not None}

    def __str__(self) -> str:
        return ",".join(f"{k}={v * 1000:g}ms" for k, v in self.as_dict().items()) or "none"

    def met(self, ttft: float | None, tpot: float | None, e2e: float | None) -> bool:
        """Every limit set is met. A missing measurement against a set limit fails it."""
        for limit, value in ((self.ttft, ttft), (self.tpot, tpot), (self.e2e, e2e)):
            if limit is not None and (value is None or value > limit):
                return False
        return True


def parse_slo(text: str | None) -> SLO:
    if text is None or not text.strip():
        return SLO()
    vals: dict[str, float] = {}
    for item in text.split(","):
        k, sep, v = item.partition("=")
        k = k.strip().lower()
        if not sep or k not in KEYS:
            raise UsageError(f"--slo: bad item {item.strip()!r} (use ttft=500ms,tpot=50ms,e2e=10s)")
        if k in vals:
            raise UsageError(f"--slo: {k} given twice")
        vals[k] = parse_duration(v, f"--slo {k}")
    if "ttft" in vals and "e2e" in vals and vals["ttft"] > vals["e2e"]:
        raise UsageError("--slo: ttft limit is larger than the e2e limit; no request could meet it")
    return SLO(**vals)

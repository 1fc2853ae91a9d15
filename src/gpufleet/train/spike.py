"""Loss-spike and NaN detection with a robust rule.

A loss is a spike when it is non-finite, or when it exceeds the rolling median by more than
``threshold`` robust standard deviations (1.4826 x MAD) *and* by more than ``min_rel`` of the median.
The median/MAD pair ignores the spikes it is looking for, unlike a mean/stddev z-score. Every rank
feeds the same all-reduced value, so every rank reaches the same verdict.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any

__all__ = ["SpikeGuard"]


class SpikeGuard:
    def __init__(
        self, window: int = 50, threshold: float = 8.0, min_history: int = 10, min_rel: float = 0.25
    ):
        if window < 3 or min_history < 3 or min_history > window:
            raise ValueError("spike guard needs 3 <= min_history <= window")
        self.window = window
        self.threshold = threshold
        self.min_history = min_history
        self.min_rel = min_rel
        self._history: deque[float] = deque(maxlen=window)

    def check(self, value: float) -> str | None:
        """Return why ``value`` is a spike, or None (and remember it) when it is normal."""
        if not math.isfinite(value):
            return f"non-finite loss ({value})"
        if len(self._history) >= self.min_history:
            med = statistics.median(self._history)
            mad = statistics.median(abs(x - med) for x in self._history)
            scale = max(1.4826 * mad, 1e-12)
            z = (value - med) / scale
            if z > self.threshold and value - med > self.min_rel * abs(med):
                return f"loss spike {value:.4g} vs rolling median {med:.4g} (robust z={z:.1f})"
        self._history.append(value)
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self._history)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self._history = deque((float(x) for x in sd.get("history", [])), maxlen=self.window)

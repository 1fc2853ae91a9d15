"""Loss-spike and NaN detection with a robust rule that scales with the loss.

A loss is a **spike** when it is non-finite, or when it passes three tests against the last
``window`` normal losses (median ``m``) at once:

1. **outlier:** its logarithm is more than ``threshold`` robust standard deviations above the median
   of their logarithms. Batch-to-batch noise of a loss is multiplicative (a loss of 2 wobbles by
   tenths, a loss of 0.02 by thousandths), so the log scale is where one z threshold means the same
   thing all run long. The standard deviation is 1.4826 x the smaller of two robust noise estimates,
   the MAD around the median and the MAD of successive differences / sqrt 2: while the loss falls
   fast the first stays wide with the trend, the second measures only the noise. Medians ignore the
   spikes they are looking for, unlike a mean/stddev z-score. (A window holding a loss <= 0 is
   judged on the linear scale.)
2. **large for where the loss is now:** its excess over ``m`` is more than ``min_rel`` x ``|m|``;
3. **large for the run:** its excess over ``m`` is more than ``level_frac`` x ``L``, where ``L`` is
   the highest rolling median the run has held (usually its starting loss). A spike must climb back
   at least a tenth (by default) of the way the loss has come down.

Test 1 alone fails on a converged model: its spread shrinks towards zero, so ordinary
batch-to-batch variation scores an enormous z. A GRU language model that went from 4.2 to 0.02 saw
batches at 0.17 (linear robust z = 59) and 0.08: real data, reproduced exactly on replay, and a
rollback for each. Test 3 makes such a blip (0.15 above the median) too small to count on a run
whose loss scale is 4.2 (floor 0.42), while the faults the guard exists for still pass it by far: a
NaN or infinity, a corrupted value (x100 or more), a divergence that sends the loss back towards its
starting level. What it cannot see, by design, is a change smaller than ``level_frac`` of the run's
loss scale: rolling back for one would cost more than it saves. ``level_frac=0`` drops test 3.

``L`` and the window are part of the guard's state (saved in every checkpoint), so a restored run
judges the next loss exactly as the uninterrupted run would have. Every rank feeds the same
all-reduced value, so every rank reaches the same verdict.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any

__all__ = ["SpikeGuard"]


class SpikeGuard:
    def __init__(
        self,
        window: int = 50,
        threshold: float = 8.0,
        min_history: int = 10,
        min_rel: float = 0.25,
        level_frac: float = 0.1,
    ):
        if window < 3 or min_history < 3 or min_history > window:
            raise ValueError("spike guard needs 3 <= min_history <= window")
        if not (threshold > 0 and min_rel >= 0 and level_frac >= 0):
            raise ValueError("spike guard needs threshold > 0, min_rel >= 0 and level_frac >= 0")
        self.window = window
        self.threshold = threshold
        self.min_history = min_history
        self.min_rel = min_rel
        self.level_frac = level_frac
        self._history: deque[float] = deque(maxlen=window)
        self.level: float | None = None  # L: the highest |rolling median| the run has held

    def floor(self, median: float) -> float:
        """The smallest excess over ``median`` that can count as a spike (tests 2 and 3)."""
        return max(self.min_rel * abs(median), self.level_frac * (self.level or 0.0))

    def check(self, value: float) -> str | None:
        """Return why ``value`` is a spike, or None (and remember it) when it is normal."""
        if not math.isfinite(value):
            return f"non-finite loss ({value})"
        if len(self._history) >= self.min_history:
            med = statistics.median(self._history)
            excess = value - med
            floor = self.floor(med)
            if excess > floor:
                z = self._z(value)
                if z > self.threshold:
                    return (
                        f"loss spike {value:.4g} vs rolling median {med:.4g} (robust z={z:.1f};"
                        f" +{excess:.3g} over the median, floor {floor:.3g} for a loss scale of"
                        f" {self.level:.3g})"
                    )
        self._history.append(value)
        if len(self._history) >= self.min_history:
            m = abs(statistics.median(self._history))
            self.level = m if self.level is None else max(self.level, m)
        return None

    def _z(self, value: float) -> float:
        """Robust z-score of ``value`` against the window (test 1; log scale for positive losses)."""
        h = list(self._history)
        if value > 0 and min(h) > 0:
            h, value = [math.log(x) for x in h], math.log(value)
        med = statistics.median(h)
        mad = statistics.median(abs(x - med) for x in h)
        diffs = statistics.median(abs(b - a) for a, b in zip(h, h[1:], strict=False)) / math.sqrt(2)
        return (value - med) / max(1.4826 * min(mad, diffs), 1e-12)

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self._history), "level": self.level}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self._history = deque((float(x) for x in sd.get("history", [])), maxlen=self.window)
        level = sd.get("level")
        if level is None and len(self._history) >= self.min_history:  # a checkpoint from before `level`
            level = abs(statistics.median(self._history))
        self.level = None if level is None else float(level)

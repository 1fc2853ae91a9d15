"""Relative (peer) checks: the one place the outlier math lives.

Two rules, both "slower than its peers" (higher is better for every measured value):

- **node peers** (a node's own devices or ranks): a device fails when it is more than ``tol`` below
  the best peer (field practice: each GPU within 10% of the best on its node);
- **fleet peers** (the same check on other nodes of the same model): a node fails when it is more than
  ``k`` scaled median absolute deviations below the median of its peers *and* at least ``min_drop``
  below it (so a fleet with a near-zero spread does not flag noise). The MAD is scaled by 1.4826 so that
  k is in standard deviations for normally distributed values.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

__all__ = ["MAD_SCALE", "mad", "node_outliers", "fleet_outlier"]

MAD_SCALE = 1.4826


def mad(xs: Sequence[float]) -> float:
    """Median absolute deviation (unscaled)."""
    if not xs:
        raise ValueError("mad of an empty sequence")
    m = statistics.median(xs)
    return statistics.median([abs(x - m) for x in xs])


def node_outliers(values: Mapping[str, float], tol: float = 0.10) -> dict[str, float]:
    """Devices more than ``tol`` below the best one: {device: shortfall as a fraction of the best}."""
    if len(values) < 2:
        return {}
    best = max(values.values())
    if best <= 0:
        return {}
    return {d: 1.0 - v / best for d, v in values.items() if v < (1.0 - tol) * best}


def fleet_outlier(
    value: float, peers: Sequence[float], k: float = 3.0, min_drop: float = 0.05, min_peers: int = 3
) -> tuple[bool, float | None]:
    """(is outlier, cut-off) for ``value`` against peer values; (False, None) with too few peers."""
    if len(peers) < min_peers:
        return False, None
    med = statistics.median(peers)
    cut = min(med - k * MAD_SCALE * mad(peers), (1.0 - min_drop) * med)
    return value < cut, cut

"""Reliability numbers from the ledger (MTBF, MTTR, goodput, badput), the checkpoint interval
policy (Young/Daly), and the report's renderers. Everything here is pure Python at import time;
plotting (matplotlib) and terminal rendering (rich) load only when used.
"""

from __future__ import annotations

from gpufleet.reliability.interval import IntervalPolicy, daly, expected_goodput, optimal_goodput, young

__all__ = ["IntervalPolicy", "daly", "young", "expected_goodput", "optimal_goodput"]

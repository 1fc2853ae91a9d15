"""Finding the bad node of a multi-node collective with pairwise tests and a second pass.

Pass 1 pairs the nodes up (0-1, 2-3, ...; an odd one out joins a pair as a third test) and measures each
pair. A pair below ``floor`` makes both of its nodes suspects. Pass 2 re-tests each suspect against a node
cleared in pass 1: slow again means the suspect is bad; fast clears it. Suspects with no cleared partner
stay ``inconclusive``. ``measure_pair(a, b) -> busbw`` is abstract so this runs anywhere (a Slurm job,
a test with a fake); it may raise ``TimeoutError`` or ``OSError``, which counts as slow.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

__all__ = ["PairwiseResult", "find_bad_nodes"]

MeasurePair = Callable[[str, str], float]


@dataclass
class PairwiseResult:
    bad: list[str] = field(default_factory=list)
    cleared: list[str] = field(default_factory=list)
    inconclusive: list[str] = field(default_factory=list)
    measurements: list[tuple[str, str, float | None]] = field(default_factory=list)


def _measure(fn: MeasurePair, a: str, b: str, out: PairwiseResult) -> float | None:
    try:
        v: float | None = float(fn(a, b))
    except (TimeoutError, OSError):
        v = None
    out.measurements.append((a, b, v))
    return v


def find_bad_nodes(nodes: Sequence[str], measure_pair: MeasurePair, floor: float) -> PairwiseResult:
    """Which of ``nodes`` make collectives slow (busbw below ``floor``)."""
    res = PairwiseResult()
    names = list(dict.fromkeys(nodes))
    if len(names) < 2:
        res.inconclusive = names
        return res
    pairs = [(names[i], names[i + 1]) for i in range(0, len(names) - 1, 2)]
    if len(names) % 2:
        pairs.append((names[-1], names[0]))
    suspects: list[str] = []
    good: list[str] = []
    for a, b in pairs:
        v = _measure(measure_pair, a, b, res)
        for n in (a, b):
            if v is None or v < floor:
                if n not in suspects:
                    suspects.append(n)
            elif n not in good:
                good.append(n)
    suspects = [s for s in suspects if s not in good]  # the odd node may be cleared by its second pair
    for i, s in enumerate(suspects):
        if not good:
            res.inconclusive.append(s)
            continue
        partner = good[i % len(good)]
        v = _measure(measure_pair, s, partner, res)
        (res.bad if v is None or v < floor else res.cleared).append(s)
    res.cleared = sorted(set(good) | set(res.cleared))
    res.bad.sort()
    res.inconclusive.sort()
    return res

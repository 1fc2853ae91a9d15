"""Each test's recorded duration, for ordering the parallel phase's groups longest first.

pytest-xdist hands each worker one group at a time (tests/conftest.py). Which group runs last decides
how long one worker works alone at the end: with a minute-long group last, the other worker idles for
that minute. The longest-processing-time-first order keeps the short groups for the end, which needs
each test's duration before it runs: ``tests/durations.json``, as ``make test-durations`` records it
(seconds of setup, call and teardown per test id). A test it does not name (a new one) counts as
:data:`UNKNOWN_S`; a stale file only makes the order less good, never a test wrong.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

__all__ = ["DURATIONS_FILE", "OUT_VAR", "UNKNOWN_S", "load", "longest_groups_first", "record"]

DURATIONS_FILE = Path(__file__).resolve().parent.parent / "durations.json"
OUT_VAR = "GPUFLEET_TEST_DURATIONS_OUT"
"""Where a run records its durations (merged into what the file holds); unset, nothing is recorded."""
UNKNOWN_S = 1.0
"""The duration of a test the file does not name: most tests take less, a new slow test is a surprise."""
RECORD_MIN_S = 0.5
"""Shorter tests are left out of the file (unknown, they count as :data:`UNKNOWN_S`; close enough)."""


def load(path: Path = DURATIONS_FILE) -> dict[str, float]:
    """Recorded seconds per test id; {} without a readable file."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): float(v) for k, v in data.items()} if isinstance(data, dict) else {}


def longest_groups_first(
    ids_and_groups: Iterable[tuple[str, str]], durations: Mapping[str, float]
) -> list[int]:
    """The positions of ``(test id, group)`` pairs in run order: groups by their summed duration, longest
    first (ties in collection order), each group's tests in collection order."""
    pairs = list(ids_and_groups)
    weight: dict[str, float] = {}
    first: dict[str, int] = {}
    for i, (nodeid, group) in enumerate(pairs):
        weight[group] = weight.get(group, 0.0) + durations.get(nodeid, UNKNOWN_S)
        first.setdefault(group, i)
    return sorted(range(len(pairs)), key=lambda i: (-weight[pairs[i][1]], first[pairs[i][1]], i))


def record(seconds: Mapping[str, float], path: Path) -> None:
    """Merge this run's durations into ``path`` (tests of the other phase keep theirs)."""
    merged = load(path)
    merged.update({k: round(v, 1) for k, v in seconds.items()})
    kept = {k: v for k, v in sorted(merged.items()) if v >= RECORD_MIN_S}
    tmp = path.with_name(f"{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(kept, indent=0, sort_keys=True) + "\n")
    os.replace(tmp, path)

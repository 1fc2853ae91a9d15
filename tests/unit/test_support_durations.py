"""The parallel phase's order: groups by recorded duration, longest first (tests/support/durations.py)."""

from __future__ import annotations

from pathlib import Path

from support import durations


def test_groups_run_longest_first_and_keep_their_tests_in_collection_order() -> None:
    pairs = [("a::1", "a"), ("b::1", "b"), ("a::2", "a"), ("c::1", "c"), ("b::2", "b")]
    recorded = {"a::1": 2.0, "a::2": 2.0, "b::1": 30.0, "c::1": 9.0}  # b::2 is new: UNKNOWN_S
    order = durations.longest_groups_first(pairs, recorded)
    assert [pairs[i][0] for i in order] == ["b::1", "b::2", "c::1", "a::1", "a::2"]


def test_groups_of_equal_weight_keep_collection_order() -> None:
    pairs = [("x::1", "x"), ("y::1", "y"), ("z::1", "z")]
    assert durations.longest_groups_first(pairs, {}) == [0, 1, 2]


def test_record_merges_runs_and_drops_short_tests(tmp_path: Path) -> None:
    out = tmp_path / "durations.json"
    durations.record({"slow::a": 12.34, "fast::b": 0.01}, out)
    durations.record({"slow::c": 3.0, "slow::a": 10.0}, out)  # the other phase, and a rerun
    assert durations.load(out) == {"slow::a": 10.0, "slow::c": 3.0}
    assert durations.load(tmp_path / "missing.json") == {}

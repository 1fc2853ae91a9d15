"""Section 4 validation: profile the real llama.cpp server, plan one instance for an SLO, run
``serve bench`` at the planned rate and compare measured p90 TTFT/TPOT with the prediction.

This test checks that the whole pipeline (profile -> plan -> bench at the planned rate) holds
together against a real server: every stage runs, the server is recognised as one-at-a-time, and
prediction and measurement agree within a factor of 2.5 (a unit or model error shows up as orders of
magnitude). It is not the accuracy figure: on a shared 2-core CI host the profiling and measuring
phases see different CPU contention (one llama.cpp thread competes with the client and whatever
else runs), and TPOT errors of -37% and +132% were seen in loaded CI runs where a quiet run measured
-12%. Accuracy against the issue's 15% goal is measured by benchmarks/bench_planner.py and recorded in
docs/benchmarks.md: performance belongs in benchmarks, not in timed tests. 24 measured requests (a
p90 from 24 is its third largest; enough for a factor-2.5 check): about 105 s idle (profile 35 s,
bench at 0.36 req/s 67 s); 40 requests add about 45 s there and took 228 s in a loaded CI run,
near the 300 s timeout.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

FACTOR = 2.5  # prediction and measurement must agree within this factor, either way


def within_factor(rel_error: float) -> bool:
    """rel_error = predicted / measured - 1; True when the ratio lies in [1/FACTOR, FACTOR]."""
    ratio = 1.0 + rel_error
    return 1.0 / FACTOR <= ratio <= FACTOR


pytestmark = [pytest.mark.slow, pytest.mark.solo, pytest.mark.timeout(300)]  # measures latency


def test_planned_rate_matches_prediction(llama_server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from bench_planner import validate

    r = validate(llama_server.url, llama_server.model, tmp_path, requests=24)
    assert r["server"]["max_batch"] == 1, r["server"]
    assert r["requests_measured"] >= 21
    errs = r["rel_error_replay"]
    assert within_factor(errs["tpot_p90_ms"]), r
    assert within_factor(errs["ttft_p90_ms"]), r
    assert within_factor(r["rel_error_plan"]["ttft_p90_ms"]), r

"""Section 4 validation: profile the real llama.cpp server, plan one instance for an SLO, run
``serve bench`` at the planned rate and compare measured p90 TTFT/TPOT with the prediction.

Tolerance here: 50% for both (65% for the planner's own TTFT prediction). This test checks that the
whole pipeline (profile -> plan -> bench at the planned rate) holds together against a real server
and lands in the right range; it is not the accuracy figure. On a shared 2-core CI host the
profiling and the measuring phases see different CPU contention (one llama.cpp thread competes
with the client and the other services), and a CI run measured TPOT 37% off where a quiet run
measured 12%. The accuracy against the issue's 15% goal is recorded by
benchmarks/bench_planner.py in docs/benchmarks.md, as performance belongs in benchmarks, not in
timed tests. llama.cpp serves one request at a time, so the profile has max_batch = 1. About 70-100 s.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

TTFT_TOL = 0.50
TPOT_TOL = 0.50

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_planned_rate_matches_prediction(llama_server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from bench_planner import validate

    r = validate(llama_server.url, llama_server.model, tmp_path, requests=40)
    assert r["server"]["max_batch"] == 1, r["server"]
    assert r["requests_measured"] >= 35
    errs = r["rel_error_replay"]
    assert abs(errs["tpot_p90_ms"]) <= TPOT_TOL, r
    assert abs(errs["ttft_p90_ms"]) <= TTFT_TOL, r
    assert abs(r["rel_error_plan"]["ttft_p90_ms"]) <= TTFT_TOL + 0.15, r

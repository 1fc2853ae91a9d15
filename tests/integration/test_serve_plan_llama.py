"""Section 4 validation: profile the real llama.cpp server, plan one instance for an SLO, run
``serve bench`` at the planned rate and compare measured p90 TTFT/TPOT with the prediction.

Tolerance: 15% for TPOT (the issue's goal) and 35% for TTFT. TTFT p90 includes queueing, is taken
from ~40 Poisson requests on a shared 2-core CI host, and moves by more than 15% between identical
runs; the benchmark (benchmarks/bench_planner.py) records the errors themselves. llama.cpp serves
one request at a time, so the profile has max_batch = 1. About 70-100 s.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

TTFT_TOL = 0.35
TPOT_TOL = 0.15

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

"""Helpers shared by the observability tests (test_observe_prometheus.py, test_mcp.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

GPUFLEET = [sys.executable, "-m", "gpufleet.cli.main"]


def report_json(run_dir: Path) -> dict[str, Any]:
    """``gpufleet report RUN_DIR --json``: what every exported number must agree with."""
    p = subprocess.run(
        [*GPUFLEET, "report", str(run_dir), "--json", "--no-plot"], capture_output=True, text=True
    )
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def bench_against_mock(out: Path, log_dir: Path, requests: int, slo: str) -> None:
    """A real ``gpufleet serve bench`` against ``gpufleet serve mock`` (stopped by PID), writing ``out``."""
    from support.llama import MockProcess

    mock = MockProcess(["--ttft", "30ms", "--itl", "5ms", "--jitter", "0"], log_dir=log_dir).start()
    try:
        p = subprocess.run(
            [*GPUFLEET, "serve", "bench", "--url", mock.url, "--out", str(out), "--no-plot", "--no-progress",
             "--workload", "in=fixed:16;out=fixed:8", "--requests", str(requests), "--rate", "8",
             "--slo", slo],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert p.returncode == 0, p.stderr[-2000:]
    finally:
        mock.stop()

"""The Run API without a supervisor: rank 0 writes the ledger itself; a spike raises."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from gpufleet.core.ledger import read_events

SCRIPT = str(Path(__file__).parent / "scripts" / "toy_train.py")


def run_standalone(run_dir: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "GPUFLEET_RUN_DIR": str(run_dir), "GPUFLEET_CKPT_EVERY": "10", **env}
    return subprocess.run(
        [sys.executable, SCRIPT, *args], capture_output=True, text=True, env=full_env, timeout=120
    )


def test_standalone_run_resumes_where_it_stopped(tmp_path):
    p = run_standalone(tmp_path, "--steps", "25")
    assert p.returncode == 0, p.stderr
    first = json.loads(next(tmp_path.glob("final-*.json")).read_text())
    assert first["start"] == 0 and first["steps"] == list(range(25))
    # Asking for more steps continues from the final checkpoint at step 25, exactly.
    p = run_standalone(tmp_path, "--steps", "40")
    assert p.returncode == 0, p.stderr
    finals = [json.loads(f.read_text()) for f in tmp_path.glob("final-*.json")]
    second = [f for f in finals if f["start"] == 25][0]
    assert second["steps"] == list(range(25, 40))
    evs = read_events(tmp_path)
    assert [e["status"] for e in evs if e["ev"] == "run_end"] == ["completed", "completed"]
    assert len({e["session"] for e in evs}) == 2


def test_standalone_spike_raises_a_clear_error(tmp_path):
    p = run_standalone(
        tmp_path, "--steps", "20", GPUFLEET_FAULTS=json.dumps([{"kind": "nan", "id": 0, "step": 12}])
    )
    assert p.returncode != 0
    assert "SpikeDetected" in p.stderr and "step 12" in p.stderr
    assert any(e["ev"] == "spike" and e["step"] == 12 for e in read_events(tmp_path))

"""Bad settings end `gpufleet run` with one line and exit code 2: before any worker starts when the
supervisor can tell, and without a restart when only a worker's ``gpufleet.init()`` can."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpufleet.core.ledger import read_events

GPUFLEET = [sys.executable, "-m", "gpufleet.cli.main"]


def _run(run_dir: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*GPUFLEET, "run", "--run-dir", str(run_dir), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--upload", "http://x"], "--upload 'http://x': must look like s3://bucket/prefix"),
        (["--mtbf", "0"], "--mtbf 0.0: must be > 0"),
        (["--keep-last", "0"], "--keep-last 0: must be >= 1"),
        (["--s3-endpoint", "minio:9000"], "--s3-endpoint 'minio:9000'"),
        (["-n", "2", "--checkpoint-every", "0s"], "--checkpoint-every '0s': invalid checkpoint interval"),
    ],
)
def test_bad_worker_setting_stops_before_any_worker_starts(tmp_path, flags, needle):
    marker = tmp_path / "started"  # the command would create it if a worker ever ran
    p = _run(tmp_path / "r", *flags, "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')")
    assert p.returncode == 2, (p.stdout, p.stderr)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("gpufleet: error: ") and needle in lines[0], p.stderr
    assert "Traceback" not in p.stderr
    assert not marker.exists()
    assert not [e for e in read_events(tmp_path / "r") if e["ev"] == "attempt_start"]


def test_bad_inherited_variable_stops_before_any_worker_starts(tmp_path):
    env = {**os.environ, "GPUFLEET_OVERLAP": "maybe"}
    p = _run(tmp_path / "r", "--", sys.executable, "-c", "pass", env=env)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "gpufleet: error: GPUFLEET_OVERLAP='maybe': must be true or false (1/0, yes/no)"
    ]


def test_worker_that_rejects_its_settings_ends_the_run_with_exit_2_and_no_restart(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import gpufleet\n\ngpufleet.init(keep_last=0)\nraise SystemExit('not reached')\n")
    run_dir = tmp_path / "r"
    p = _run(run_dir, "-n", "2", "--max-restarts", "5", "--no-progress", "--", sys.executable, str(script))
    assert p.returncode == 2, (p.stdout, p.stderr)
    msg = "gpufleet.init(keep_last=0): must be >= 1"
    assert p.stderr.strip().splitlines()[-1] == f"gpufleet: error: a worker rejected its settings: {msg}"
    assert "Traceback" not in p.stderr and "not reached" not in p.stderr
    events = list(read_events(run_dir))
    kinds = [e["ev"] for e in events]
    assert kinds.count("attempt_start") == 1 and "restart" not in kinds and "failure" not in kinds
    end = [e for e in events if e["ev"] == "run_end"]
    assert end and end[0]["status"] == "config_error" and end[0]["exit_code"] == 2
    assert [e["reason"] for e in events if e["ev"] == "give_up"] == [f"configuration error: {msg}"]

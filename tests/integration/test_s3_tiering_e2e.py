"""Supervised training with an S3 tier (real SeaweedFS): upload after commit, restore from S3 when the
local copies are gone, and commit through a proxy that fails a fraction of requests."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpufleet.core.ledger import read_events

pytestmark = [pytest.mark.slow, pytest.mark.s3]

SCRIPT = str(Path(__file__).parent / "scripts" / "toy_train.py")


def supervised(
    run_dir: Path, url: str, endpoint: str, steps: int, *flags: str
) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable,
        "-m",
        "gpufleet.cli.main",
        "run",
        "-n",
        "2",
        "--run-dir",
        str(run_dir),
        "--checkpoint-every",
        "10",
        "--upload",
        url,
        "--s3-endpoint",
        endpoint,
        "--no-progress",
        *flags,
        "--",
        sys.executable,
        SCRIPT,
        "--steps",
        str(steps),
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=dict(os.environ))


def evs(run_dir: Path, name: str) -> list[dict]:
    return [e for e in read_events(run_dir) if e["ev"] == name]


def test_restore_falls_back_to_s3_when_local_copies_are_gone(tmp_path, s3_url, s3_server):
    p = supervised(tmp_path, s3_url, s3_server.endpoint, 30, "--inject", "kill:rank=1,step=22")
    assert p.returncode == 0, p.stderr[-3000:]
    uploaded = {e["step"] for e in evs(tmp_path, "ckpt_uploaded")}
    assert 30 in uploaded and len(uploaded) >= 2
    assert s3_server.secret_key not in (tmp_path / "ledger.jsonl").read_text()  # never log credentials

    shutil.rmtree(tmp_path / "checkpoints")  # the node's disk is gone; the S3 tier is not
    p = supervised(tmp_path, s3_url, s3_server.endpoint, 40)
    assert p.returncode == 0, p.stderr[-3000:]
    last_restore = evs(tmp_path, "restore")[-1]
    assert last_restore["source"] == "s3" and last_restore["step"] == 30


def test_checkpoints_commit_and_upload_through_a_flaky_s3(tmp_path, s3_url, s3_server):
    from support.flaky_proxy import FlakyProxy

    proxy = FlakyProxy(s3_server.endpoint, error_rate=0.25, seed=7).start()
    try:
        p = supervised(tmp_path, s3_url, proxy.endpoint, 30)
        stats = proxy.stats()
    finally:
        proxy.stop()
    assert p.returncode == 0, p.stderr[-3000:]
    assert stats["injected"] > 0, stats  # errors really were injected
    assert {e["step"] for e in evs(tmp_path, "ckpt_uploaded")} >= {30}
    assert not evs(tmp_path, "ckpt_failed")

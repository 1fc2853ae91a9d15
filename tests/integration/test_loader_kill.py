"""A plain DataLoader(shuffle=True, num_workers=2) under `gpufleet run -n 2`, killed mid-epoch by an
external kill -9, ends bit-identical to an unkilled run and trains every batch exactly once
(tests/integration/scripts/loader_train.py; real supervisor, gloo). A resume with a changed dataset
ends the run with exit 2 instead of restarting."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpufleet.core.ledger import read_events
from integration.test_supervisor import GPUFLEET, evs, final

pytestmark = pytest.mark.slow

SCRIPT = str(Path(__file__).parent / "scripts" / "loader_train.py")
STEPS, PER_EPOCH, EVERY = 60, 25, 7  # 200 samples / batch 8; every checkpoint step is mid-epoch


def _cmd(run_dir: Path, *extra: str) -> list[str]:
    return [
        *GPUFLEET,
        "run",
        "-n",
        "2",
        "--run-dir",
        str(run_dir),
        "--checkpoint-every",
        str(EVERY),
        "--no-progress",
        "--",
        sys.executable,
        SCRIPT,
        "--steps",
        str(STEPS),
        *extra,
    ]


def _trained(run_dir: Path, rank: int) -> dict[int, list[int]]:
    """Step -> sample indices trained at that step; a step re-run after a restart keeps its last record."""
    out: dict[int, list[int]] = {}
    for line in (run_dir / f"seen-rank{rank}.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec["idx"]
    return out


def test_external_kill_mid_epoch_resumes_bit_identical(tmp_path: Path) -> None:
    ref_dir = tmp_path / "reference"
    ref = subprocess.run(_cmd(ref_dir), capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert not evs(ref_dir, "failure")

    run_dir = tmp_path / "killed"
    proc = subprocess.Popen(
        _cmd(run_dir, "--sleep", "0.05"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        # wait for a committed checkpoint in the second epoch, then kill rank 1 from outside
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            committed = [e["step"] for e in evs(run_dir, "ckpt_committed")] if run_dir.exists() else []
            if committed and max(committed) >= 4 * EVERY:
                break
            assert proc.poll() is None, "the run ended before the kill"
            time.sleep(0.1)
        else:
            pytest.fail("no checkpoint committed in the second epoch")
        pids = evs(run_dir, "attempt_start")[-1]["pids"]
        os.kill(pids[1], signal.SIGKILL)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]

    failures = evs(run_dir, "failure")
    assert [(f["cause"], f["rank"]) for f in failures] == [("crash", 1)]
    restores = evs(run_dir, "restore")
    assert len(restores) == 2 and restores[0]["fresh"] and not restores[1]["fresh"]
    resumed = restores[1]["step"]
    assert resumed >= 4 * EVERY and resumed % PER_EPOCH != 0, f"resumed at {resumed}: not mid-epoch"
    # restored from a verified checkpoint at least as new as every commit the ledger saw before the kill
    events = read_events(run_dir)
    before = events[: events.index(next(e for e in events if e["ev"] == "failure"))]
    assert resumed >= max(e["step"] for e in before if e["ev"] == "ckpt_committed")

    assert final(run_dir)["sha256"] == final(ref_dir)["sha256"]
    for rank in (0, 1):
        ref_seen, got = _trained(ref_dir, rank), _trained(run_dir, rank)
        assert sorted(got) == list(range(STEPS))
        assert got == ref_seen, f"rank {rank} trained other batches than the unkilled run"
        for epoch_start in range(0, STEPS - PER_EPOCH + 1, PER_EPOCH):  # every full epoch: each sample once
            samples = [i for s in range(epoch_start, epoch_start + PER_EPOCH) for i in got[s]]
            assert sorted(samples) == list(range(200))


def test_resuming_with_a_changed_dataset_ends_the_run_with_exit_2(tmp_path: Path) -> None:
    first = subprocess.run(_cmd(tmp_path, "--num-workers", "0"), capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    changed = [a if a != str(STEPS) else str(STEPS + 10) for a in _cmd(tmp_path, "--num-workers", "0")]
    p = subprocess.run([*changed, "--samples", "240"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-3000:]
    assert "changed since the checkpoint (samples 200 -> 240" in p.stderr
    assert not evs(tmp_path, "restart")  # terminal: no restart would fix it

"""Helpers shared by the real-Slurm tests (test_slurm_cluster.py, test_slurm_requeue.py).

The cluster is .ci/slurm.sh's: slurmctld + slurmd n1..n3 on this host, its state under
``GPUFLEET_TEST_SLURM_DIR`` (default .ci/state/slurm).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpufleet.backends.slurm import actions as S

requires_slurm = pytest.mark.skipif(
    shutil.which("sinfo") is None or not os.environ.get("SLURM_CONF"),
    reason="needs real Slurm: run `.ci/slurm.sh start && source .ci/state/slurm.env` (.ci/run does)",
)

SCRIPT = str(Path(__file__).parent / "scripts" / "toy_train.py")
STATE = Path(os.environ.get("GPUFLEET_TEST_SLURM_DIR", ".ci/state/slurm"))
NODES = ("n1", "n2", "n3")


def sh(*argv: str, timeout: float = 20) -> str:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=True).stdout


def states() -> dict[str, S.NodeInfo]:
    return {n.name: n for n in S.cluster_nodes()}


def wait_for(pred, timeout: float, what: str, every: float = 0.5):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; nodes: {states()}")


def slurmd_pid(node: str) -> int | None:
    p = STATE / f"slurmd-{node}.pid"
    if not p.exists():
        return None
    pid = int(p.read_text().strip() or 0)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    return pid


def restore_cluster() -> None:
    """slurmd up on every node, every drain undone (admin ones too: the tests made them), all idle."""
    for n in NODES:
        if slurmd_pid(n) is None:
            sh("slurmd", "-f", os.environ["SLURM_CONF"], "-N", n)
    for n, info in states().items():
        if info.drained or info.state.startswith("down"):
            subprocess.run(["scontrol", "update", f"nodename={n}", "state=resume"], timeout=15, check=False)
    wait_for(lambda: all(i.state == "idle" for i in states().values()), 60, "all nodes idle")


def submit_run(run_dir: Path, *flags: str, job_name: str, steps: int, sleep: float = 0.0) -> str:
    """``gpufleet run --backend slurm`` of the toy training script; returns the job id."""
    cmd = [
        sys.executable,
        "-m",
        "gpufleet.cli.main",
        "run",
        "--backend",
        "slurm",
        "--job-name",
        job_name,
        "--run-dir",
        str(run_dir),
        "--checkpoint-every",
        "5",
        "--hang-timeout",
        "5",
        *flags,
        "--",
        sys.executable,
        SCRIPT,
        "--steps",
        str(steps),
        "--sleep",
        str(sleep),
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout.strip()


def final(run_dir: Path) -> dict:
    outs = sorted(run_dir.glob("final-*.json"), key=lambda p: p.stat().st_mtime)
    assert outs, f"no final weights in {run_dir}: {[p.name for p in run_dir.iterdir()]}"
    return json.loads(outs[-1].read_text())


def kill(*pids: int) -> None:
    """SIGKILL each pid, skipping those already gone."""
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


REFERENCE_STEPS = 40
_ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL")


def job_info(jobid: str) -> dict[str, str]:
    """``scontrol show job -o``: kept by slurmctld for MinJobAge (300 s) after the job ends."""
    p = subprocess.run(["scontrol", "show", "job", "-o", jobid], capture_output=True, text=True, timeout=15)
    return dict(t.split("=", 1) for t in p.stdout.split() if "=" in t)


def slurm_out(run_dir: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in run_dir.glob("slurm-*.out"))


def wait_job_end(jobid: str, run_dir: Path, timeout: float) -> dict[str, str]:
    """Until the job has ended for good (a requeued job goes back to PENDING, not to an end state)."""
    try:
        wait_for(lambda: job_info(jobid).get("JobState") in _ENDED, timeout, f"job {jobid} to end", every=1)
    except AssertionError:
        state = job_info(jobid).get("JobState")
        raise AssertionError(f"job {jobid}: {state}; output:\n{slurm_out(run_dir)[-4000:]}") from None
    return job_info(jobid)


def clean_reference_run(run_dir: Path) -> dict:
    """A clean, uninterrupted 2-node x 1-rank job of ``REFERENCE_STEPS`` steps: ``dir``, ``job`` and the
    ``final`` record, the bit-identical reference of the node-loss and requeue tests."""
    name = "gpufleet-test-reference"
    subprocess.run(["scancel", f"--name={name}"], timeout=15, check=False)
    restore_cluster()
    jobid = submit_run(run_dir, "--nodes", "2", job_name=name, steps=REFERENCE_STEPS)
    info = wait_job_end(jobid, run_dir, timeout=120)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", slurm_out(run_dir)
    record = final(run_dir)
    assert record["steps"] == list(range(REFERENCE_STEPS))
    return {"dir": run_dir, "job": jobid, "final": record}

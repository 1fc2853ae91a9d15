"""The batch script's requeue paths, against real Slurm daemons (.ci/slurm.sh: slurmctld + n1..n3).

(1) Time limit: Slurm's ``--signal=B:USR1@120``, delivered now with ``scancel --signal=USR1 --batch``
as slurmctld would: every rank takes a final checkpoint at the step it reached, the run ends
``interrupted``, the script requeues the job, and the requeued job resumes from that checkpoint and
finishes bit-identical to an uninterrupted run.
(2) Too few nodes: 2 nodes, no spare, ``--min-nodes 2``; n2 dies (slurmd, its step, its ranks): the
supervisor drains n2 and leaves the requeue mark, the script requeues the job, and it finishes on
n1+n3 from the newest verified checkpoint, bit-identical.
Each test puts the nodes back (slurmd restarted, drains undone) so the tests stay independent.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from slurm_helpers import (
    REFERENCE_STEPS,
    final,
    kill,
    requires_slurm,
    restore_cluster,
    sh,
    slurm_out,
    slurmd_pid,
    states,
    submit_run,
    wait_for,
    wait_job_end,
)

from gpufleet.core.ledger import read_events

pytestmark = [pytest.mark.slow, pytest.mark.cluster("slurm"), requires_slurm]

NAME = "gpufleet-test-requeue"  # own job name: scancel --name in the teardown touches only ours
STEPS = REFERENCE_STEPS


@pytest.fixture(autouse=True)
def clean_cluster(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUFLEET_FLEET_DIR", str(tmp_path / "fleet"))
    restore_cluster()
    yield
    subprocess.run(["scancel", f"--name={NAME}"], timeout=15, check=False)
    restore_cluster()


def submit(run_dir: Path, *flags: str, sleep: float = 0.0) -> str:
    return submit_run(run_dir, *flags, job_name=NAME, steps=STEPS, sleep=sleep)


def sessions(run_dir: Path) -> list[list[dict]]:
    """The ledger split by supervisor session (one per run of the batch script), in order."""
    out: dict[str, list[dict]] = {}
    for e in read_events(run_dir):
        out.setdefault(e.get("session", ""), []).append(e)
    return [evs for evs in out.values() if any(e["ev"] == "run_start" for e in evs)]


def of(evs: list[dict], name: str) -> list[dict]:
    return [e for e in evs if e["ev"] == name]


@pytest.fixture
def reference(slurm_reference) -> dict:
    """A clean, uninterrupted 2-node x 1-rank run of the same job."""
    return slurm_reference["final"]


def test_time_limit_signal_final_checkpoint_then_requeue(tmp_path, reference):
    d = tmp_path / "run"
    jobid = submit(d, "--nodes", "2", sleep=0.3)
    wait_for(lambda: d.exists() and of(read_events(d), "ckpt_committed"), 90, "a committed checkpoint")
    # What slurmctld does 120 s before the time limit (--signal=B:USR1@120): USR1 to the batch shell.
    sh("scancel", "--signal=USR1", "--batch", jobid)
    info = wait_job_end(jobid, d, timeout=150)
    out = slurm_out(d)
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) == 1, out
    assert f"gpufleet: requeueing job {jobid} (rc=0, time limit=1)" in out
    first, second = sessions(d)
    # The first run stopped early, with a final checkpoint of the step it had reached.
    assert [e["status"] for e in of(first, "run_end")] == ["interrupted"]
    reached = max(e["step"] for e in of(first, "step")) + 1  # steps done: the checkpoint's number
    assert 0 < reached < STEPS
    assert max(e["step"] for e in of(first, "ckpt_committed")) == reached
    assert not of(first, "failure")
    # The requeued run (same job id) restored exactly that checkpoint and finished the job.
    (restore,) = of(second, "restore")
    assert not restore["fresh"] and restore["step"] == reached
    assert [e["status"] for e in of(second, "run_end")] == ["completed"]
    res = final(d)
    assert res["start"] == reached and res["steps"] == list(range(reached, STEPS))
    assert res["sha256"] == reference["sha256"]


def test_below_min_nodes_requeues_without_the_lost_node(tmp_path, reference):
    d = tmp_path / "run"
    jobid = submit(d, "--nodes", "2", "--min-nodes", "2", sleep=0.3)
    report = d / "agents" / "attempt-0" / "n2.json"
    wait_for(lambda: report.exists() and of(read_events(d), "ckpt_committed"), 90, "a committed checkpoint")
    a = json.loads(report.read_text())
    pid = slurmd_pid("n2")
    assert pid is not None
    kill(pid, a["ppid"], a["pid"], *a["pids"])  # the node dies: slurmd, its step, its ranks
    info = wait_job_end(jobid, d, timeout=150)
    out = slurm_out(d)
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) == 1, out
    assert f"gpufleet: requeueing job {jobid} (rc=" in out
    assert not (d / ".gpufleet-requeue").exists()
    first, second = sessions(d)
    # First run: n2 lost, 1 healthy node < --min-nodes 2: no restart in the allocation, requeue.
    assert [e["node"] for e in of(first, "node_lost")] == ["n2"]
    (give_up,) = of(first, "give_up")
    assert "need 2" in give_up["reason"] and "requeue without n2" in give_up["reason"]
    assert [e["status"] for e in of(first, "run_end")] == ["nodes_lost"]
    assert len(of(first, "attempt_start")) == 1
    committed = max(e["step"] for e in of(first, "ckpt_committed"))
    # Requeued run: placed without n2 (drained), restored the newest verified checkpoint, finished.
    assert [s["nodes"] for s in of(second, "attempt_start")] == [["n1", "n3"]]
    assert "n2" not in info["NodeList"]
    (restore,) = of(second, "restore")
    assert not restore["fresh"] and restore["step"] >= committed > 0
    assert [e["status"] for e in of(second, "run_end")] == ["completed"]
    assert final(d)["sha256"] == reference["sha256"]
    n2 = states()["n2"]
    assert n2.drained and n2.reason.startswith("gpufleet: node-lost:")
    from gpufleet.backends.slurm.sbatch import exclusions

    assert exclusions() == ["n2"]

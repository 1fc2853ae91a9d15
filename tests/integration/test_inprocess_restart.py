"""In-process restart (`gpufleet run --in-process-restart`) on real multi-process gloo training.

The survivors of a crash or a hang keep their process and rejoin a new rendezvous round with a
replacement rank; the run still ends bit-identical to an unfailed one. Unsafe cases fall back to a
full restart, and the ledger says which path was taken and why.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpufleet.core.ledger import read_events
from support import toyrun
from support.toyrun import SCRIPT, assert_usage_error, final_sha

pytestmark = pytest.mark.slow


def _evs(run_dir: Path, name: str) -> list[dict]:
    return [e for e in read_events(run_dir) if e["ev"] == name]


def _newest_commit_before_each_failure(run_dir: Path) -> list[int]:
    newest, out = None, []
    for e in read_events(run_dir):
        if e["ev"] == "ckpt_committed":
            newest = e["step"]
        elif e["ev"] == "failure":
            out.append(newest)
    return out


@pytest.fixture
def reference_sha(toy_reference) -> str:
    return toy_reference(steps=30)["sha256"]


def gpufleet_run(run_dir: Path, *flags: str, **kw) -> subprocess.CompletedProcess[str]:
    """In-process recovery promotes hot spares where a rank has one: these runs keep theirs."""
    return toyrun.gpufleet_run(run_dir, *flags, standby=True, **kw)


def test_crash_and_hang_recover_in_process_bit_identical(tmp_path, reference_sha):
    p = gpufleet_run(
        tmp_path,
        "--in-process-restart",
        "--memory-tier",
        "64MiB",
        "--inject",
        "kill:rank=1,step=12,settle=1",
        "--inject",
        "hang:rank=0,step=22,settle=1",
        steps=30,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert [e["cause"] for e in _evs(tmp_path, "failure")] == ["crash", "hang"]
    restarts = _evs(tmp_path, "restart")
    assert [e["path"] for e in restarts] == ["in_process", "in_process"]
    assert all(e.get("fallback") is None for e in restarts)
    # The survivor keeps its process: rank 0's pid across the crash, rank 1's across rank 0's hang.
    pids = [e["pids"] for e in _evs(tmp_path, "attempt_start")]
    assert len(pids) == 3
    assert pids[1][0] == pids[0][0] and pids[1][1] != pids[0][1]
    assert pids[2][1] == pids[1][1] and pids[2][0] != pids[1][0]
    # Each survivor said why it left its collective; each new round restored from a checkpoint.
    rejoins = _evs(tmp_path, "rejoin")
    assert [(e["rank"], e["attempt"]) for e in rejoins] == [(0, 1), (1, 2)]
    assert all(e["abort_s"] >= 0 and e["reason"] for e in rejoins)
    # In place: the survivors kept their objects (no re-run of the script), and each replacement was
    # a hot spare, built for its rank before the failure.
    assert all(e["in_place"] for e in rejoins)
    ready = {(e["attempt"], e["rank"]): e for e in _evs(tmp_path, "worker_ready")}
    assert ready[(1, 1)]["hot_spare"] and ready[(2, 0)]["hot_spare"]
    assert not ready[(1, 0)]["hot_spare"] and not ready[(2, 1)]["hot_spare"]
    text = (tmp_path / "ledger.jsonl").read_text()  # strict JSON: no NaN from a worker's event
    lines = "[" + ",".join(text.splitlines()) + "]"
    json.loads(lines, parse_constant=lambda c: pytest.fail(f"{c} in the ledger"))
    # Nothing read back: the surviving rank 0 copied its own snapshot of the commit into its objects
    # (source: process); after the hang, rank 0 was a hot spare that had preloaded that commit while
    # it waited (verified, from the memory tier or disk).
    restores = _evs(tmp_path, "restore")
    assert [r["fresh"] for r in restores] == [True, False, False]
    assert [r.get("preloaded", False) for r in restores] == [False, True, True]
    assert restores[1]["source"] == "process" and restores[2]["source"] in ("memory", "local")
    assert [r["step"] for r in restores[1:]] == _newest_commit_before_each_failure(tmp_path)
    assert final_sha(tmp_path) == reference_sha


def test_a_survivor_without_the_newest_commit_in_memory_loads_it_from_storage(tmp_path, reference_sha):
    # The first save after step 5 fails after staging over the survivor's snapshot of step 5, and
    # rank 1 dies before the next one: the survivor does not hold the newest commit in its own memory,
    # so the round reads it back (verified), still in place and with a hot spare, and ends
    # bit-identical. The failed save does not fail the run at its end either: later ones committed.
    p = gpufleet_run(
        tmp_path,
        "--in-process-restart",
        "--inject",
        "ckpt_fail:step=10",
        "--inject",
        "kill:rank=1,step=14,settle=1",
        steps=30,
        extra=("--sleep", "0.05"),  # step 5's save usually persists before step 10's is due
    )
    assert p.returncode == 0, p.stderr[-3000:]
    evs = read_events(tmp_path)
    assert [e["step"] for e in evs if e["ev"] == "ckpt_committed" and e.get("attempt") == 0] == [5]
    (failed,) = [e["step"] for e in evs if e["ev"] == "ckpt_failed"]
    assert failed >= 10
    assert len([e for e in evs if e["ev"] == "failure"]) == 1
    (restart,) = _evs(tmp_path, "restart")
    assert restart["path"] == "in_process"
    (rejoin,) = _evs(tmp_path, "rejoin")
    assert rejoin["in_place"]
    restores = _evs(tmp_path, "restore")
    # Under load step 5's save may still be persisting when the next ones are due: they are skipped
    # until rank 1 dies, the survivor still holds step 5, and the round restores it in place without
    # storage (the failing save is then the new round's). Which one happened, the ledger says: a save
    # staged after step 5 in attempt 0 (rank 0's ckpt_staged) is what dropped the survivor's copy.
    staged = [e["step"] for e in evs if e["ev"] == "ckpt_staged" and e.get("attempt") == 0 and e["step"] > 5]
    assert [(r["step"], r.get("preloaded", False)) for r in restores[1:]] == [(5, not staged)]
    assert restores[1]["source"] in (("memory", "local") if staged else ("process",))
    assert final_sha(tmp_path) == reference_sha


@pytest.mark.parametrize("script_flag", ["--user-allreduce", "--own-comm-hook"])
def test_a_scripts_own_collective_rejoins_by_running_the_script_again(tmp_path, reference_sha, script_flag):
    # The script all-reduces a value of its own, or gives DDP its own communication hook: the dead
    # peer's error escapes the step (the run cannot absorb it, nor move that DDP to a new group), so
    # the survivor cannot stay in place; the harness catches it and runs the script again in the
    # same process, and the round's other ranks build too.
    p = gpufleet_run(
        tmp_path,
        "--in-process-restart",
        "--inject",
        "kill:rank=1,step=12,settle=1",
        steps=30,
        extra=(script_flag,),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    (restart,) = _evs(tmp_path, "restart")
    assert restart["path"] == "in_process"
    (rejoin,) = _evs(tmp_path, "rejoin")
    assert rejoin["rank"] == 0 and not rejoin["in_place"]
    pids = [e["pids"] for e in _evs(tmp_path, "attempt_start")]
    assert pids[1][0] == pids[0][0]
    assert final_sha(tmp_path) == reference_sha


def test_without_a_hot_spare_every_rank_of_the_round_builds_again(tmp_path, reference_sha):
    # Rank 1's spares die while they build, so the lost rank 1 has no spare: every rank of the next
    # round runs the script (a survivor in place, or rank 0's spare, beside a rank that builds would
    # deadlock: DDP's constructor is a collective only the building ranks call). Whether rank 1's spare
    # was already dead at the failure (an in-process round told to rebuild) or died once promoted (a
    # second failure, then a full restart), the run completes, bit-identical.
    p = gpufleet_run(
        tmp_path,
        "--in-process-restart",
        "--inject",
        "kill:rank=1,step=20,settle=1",
        steps=30,
        extra=("--rank1-spares-fail", "--sleep", "0.05"),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    restarts = _evs(tmp_path, "restart")
    assert restarts[0]["path"] == "in_process"
    ready = _evs(tmp_path, "worker_ready")
    last = max(e["attempt"] for e in ready)
    assert last >= 1
    finals = [e for e in ready if e["attempt"] == last]
    assert sorted(e["rank"] for e in finals) == [0, 1]
    assert not any(e["hot_spare"] for e in finals)  # the round that completed was built by every rank
    assert final_sha(tmp_path) == reference_sha


def test_repeated_failure_at_one_step_falls_back_to_a_full_restart(tmp_path, reference_sha):
    # persist=1: the kill fires again at step 12 after the first (in-process) restart.
    p = gpufleet_run(
        tmp_path, "--in-process-restart", "--inject", "kill:rank=1,step=12,settle=1,persist=1", steps=30
    )
    # The persistent drill fires on every attempt at step 12, so the run ends on its no-progress breaker.
    assert p.returncode == 3, p.stderr[-3000:]
    restarts = _evs(tmp_path, "restart")
    assert restarts[0]["path"] == "in_process"
    assert restarts[1]["path"] == "full"
    assert "second failure at step" in restarts[1]["fallback"]
    # A full restart replaces every process.
    pids = [e["pids"] for e in _evs(tmp_path, "attempt_start")]
    assert not set(pids[2]) & set(pids[1])


def test_spike_takes_the_full_path_and_still_ends_bit_identical(tmp_path, reference_sha):
    p = gpufleet_run(tmp_path, "--in-process-restart", "--inject", "nan:step=14", steps=30)
    assert p.returncode == 0, p.stderr[-3000:]
    (restart,) = _evs(tmp_path, "restart")
    assert restart["path"] == "full" and "spike" in restart["fallback"]
    assert final_sha(tmp_path) == reference_sha


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--in-process-restart", "--", "bash", "train.sh"], "python SCRIPT"),
        (["--in-process-restart", "--backend", "srun", "--", sys.executable, SCRIPT], "local backend"),
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path, flags, needle):
    assert_usage_error(tmp_path / "r", flags, needle)

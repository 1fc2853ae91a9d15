"""The supervisor against real multi-process gloo training (tests/integration/scripts/toy_train.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpufleet.core.ledger import read_events
from support.toyrun import assert_usage_error, final, gpufleet_run

pytestmark = pytest.mark.slow

SCRIPT = str(Path(__file__).parent / "scripts" / "toy_train.py")
GPUFLEET = [sys.executable, "-m", "gpufleet.cli.main"]


def evs(run_dir: Path, name: str) -> list[dict]:
    return [e for e in read_events(run_dir) if e["ev"] == name]


def test_crash_hang_nan_recover_bit_identical(tmp_path, toy_reference):
    p = gpufleet_run(
        tmp_path,
        "--inject",
        "kill:rank=1,step=12,settle=1",
        "--inject",
        "hang:rank=0,step=22,settle=1",
        "--inject",
        "nan:step=31",
        standby=True,  # the default path of `gpufleet run`: restarts promote standby interpreters
    )
    assert p.returncode == 0, p.stderr[-3000:]
    causes = [e["cause"] for e in evs(tmp_path, "failure")]
    assert causes == ["crash", "hang", "spike"]
    assert len(evs(tmp_path, "restart")) == 3
    hang = [e for e in evs(tmp_path, "failure") if e["cause"] == "hang"][0]
    assert hang["rank"] == 0  # the silent rank is blamed, not its blocked peer
    # settle=1: the save due before each kill/hang has committed when the fault fires, so every restart
    # resumes from a verified checkpoint at least as new as every commit the ledger saw before it.
    # (Which saves commit depends on machine load: one still persisting makes the next one skip. A
    # commit may land on disk just as its rank exits, before its event is sent: the restore then
    # rightly finds and verifies it.)
    events = read_events(tmp_path)
    restores = [i for i, e in enumerate(events) if e["ev"] == "restore"]
    assert len(restores) == 4 and events[restores[0]]["fresh"]
    for i in restores[1:]:
        committed = [e["step"] for e in events[:i] if e["ev"] == "ckpt_committed"]
        verified = [e["step"] for e in events[:i] if e["ev"] == "ckpt_verified"]
        assert events[i]["step"] >= (max(committed) if committed else 0)
        assert not events[i]["fresh"] and verified and verified[-1] == events[i]["step"]
    assert final(tmp_path)["sha256"] == toy_reference()["sha256"]
    end = evs(tmp_path, "run_end")[-1]
    assert end["status"] == "completed" and end["restarts"] == 3


def test_three_ranks_resume_bit_identical_after_a_crash_and_an_in_process_restart(tmp_path, toy_reference):
    # With 3+ ranks the sum order of DDP's all-reduce depends on its bucket layout, which a new DDP
    # (every restart) first has differently: gpufleet.train.exactddp replays the rebuilt layout.
    crash, inproc = tmp_path / "crash", tmp_path / "inproc"
    kill = ("--inject", "kill:rank=1,step=12,settle=1")
    p = gpufleet_run(crash, *kill, nproc=3)
    assert p.returncode == 0, p.stderr[-3000:]
    p = gpufleet_run(inproc, "--in-process-restart", *kill, nproc=3)
    assert p.returncode == 0, p.stderr[-3000:]
    for d, path in ((crash, "full"), (inproc, "in_process")):
        assert [e["path"] for e in evs(d, "restart")] == [path]
        assert [e["step"] for e in evs(d, "restore")][1] > 0  # 10 or 5: a save in flight skips the next
        assert final(d)["sha256"] == toy_reference(nproc=3)["sha256"], d.name
    # The layout travels in the checkpoint's meta: parameter names per rebuilt bucket.
    manifest = json.loads(next((crash / "checkpoints").glob("step_*/manifest.json")).read_text())
    layout = manifest["meta"]["ddp_buckets"]
    assert layout == [["3.bias", "3.weight", "0.bias", "0.weight"]]  # one bucket, in backward's order


def test_recurring_spike_rolls_back_and_skips_its_batches(tmp_path):
    p = gpufleet_run(tmp_path, "--inject", "spike:step=30,factor=1000,persist=1", steps=45, extra=())
    assert p.returncode == 0, p.stderr[-3000:]
    rb = evs(tmp_path, "rollback")
    assert [r["mode"] for r in rb] == ["replay", "skip"]
    assert [r["data_driven"] for r in rb] == [False, True]  # the replay reproduced it
    assert rb[1]["skip_to"] == 31 and rb[1]["to_step"] <= 30 - 10
    skips = evs(tmp_path, "skip")
    assert skips and skips[0]["skipped_to"] == 31
    seen = final(tmp_path)["steps"]
    assert 30 not in seen and seen[-1] == 44


def test_max_rollbacks_breaker(tmp_path):
    p = gpufleet_run(tmp_path, "--max-rollbacks", "1", "--inject", "nan:step=8,persist=1", steps=20)
    assert p.returncode == 5, p.stderr[-2000:]
    assert evs(tmp_path, "run_end")[-1]["status"] == "max_rollbacks"


def test_injected_spikes_and_nans_across_the_run_are_all_caught_within_the_rollback_rate(tmp_path):
    """Four drills across a converging run (loss 13 -> ~0.5): each is caught at its step and cleared
    by the replay. Four rollbacks exceed the old lifetime cap of 3, but not 3 per 20 steps."""
    drills = {15: "spike", 45: "nan", 75: "spike", 100: "nan"}
    specs = [a for step, kind in drills.items() for a in ("--inject", f"{kind}:step={step}")]
    p = gpufleet_run(tmp_path, "--rollback-window", "20", *specs, steps=110, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert [e["step"] for e in evs(tmp_path, "spike")] == list(drills)
    assert [r["mode"] for r in evs(tmp_path, "rollback")] == ["replay"] * 4
    rep = subprocess.run([*GPUFLEET, "report", str(tmp_path), "--json"], capture_output=True, text=True)
    spikes = json.loads(rep.stdout)["spikes"]
    assert spikes["flagged"] == spikes["injected"] == spikes["outcome"]["transient"] == 4
    assert spikes["non_finite"] == 2 and spikes["false_alarms"] == 0


def test_no_progress_breaker_has_its_own_exit_code(tmp_path):
    cmd = [
        *GPUFLEET,
        "run",
        "-n",
        "1",
        "--run-dir",
        str(tmp_path),
        "--no-progress",
        "--max-no-progress",
        "2",
        "--",
        sys.executable,
        "-c",
        "import sys; sys.exit(7)",
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert p.returncode == 3, p.stderr
    assert len(evs(tmp_path, "failure")) == 2
    assert "no checkpoint progress" in evs(tmp_path, "give_up")[0]["reason"]


def test_restart_budget(tmp_path):
    p = gpufleet_run(
        tmp_path,
        "--max-restarts",
        "1",
        "--max-no-progress",
        "0",
        "--inject",
        "kill:rank=0,step=7,persist=1",
        steps=20,
    )
    assert p.returncode == 4, p.stderr[-2000:]
    assert evs(tmp_path, "run_end")[-1]["status"] == "max_restarts"


def test_sigterm_takes_a_final_checkpoint_and_exits_cleanly(tmp_path):
    cmd = [
        *GPUFLEET,
        "run",
        "-n",
        "2",
        "--run-dir",
        str(tmp_path),
        "--checkpoint-every",
        "1000",
        "--no-progress",
        "--",
        sys.executable,
        SCRIPT,
        "--steps",
        "100000",
        "--sleep",
        "0.01",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(evs(tmp_path, "step")) < 20:
        time.sleep(0.2)
    assert len(evs(tmp_path, "step")) >= 20, "training did not start"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    assert evs(tmp_path, "run_end")[-1]["status"] == "interrupted"
    last_step = evs(tmp_path, "step")[-1]["step"]
    committed = evs(tmp_path, "ckpt_committed")
    assert committed and committed[-1]["step"] == last_step + 1  # nothing after the last step is lost
    assert (tmp_path / "checkpoints" / f"step_{last_step + 1:08d}" / "manifest.json").exists()


@pytest.mark.parametrize(
    "flags, needle",
    [
        ([], "no training command"),
        (["--inject", "explode:step=3", "--", sys.executable, SCRIPT], "unknown fault kind"),
        (["--inject", "kill:rank=1", "--", sys.executable, SCRIPT], "needs step"),
        (["--checkpoint-every", "often", "--", sys.executable, SCRIPT], "invalid checkpoint interval"),
        (["-n", "0", "--", sys.executable, SCRIPT], "nproc"),
        (["--backend", "moon", "--", sys.executable, SCRIPT], "valid backends: local"),
        (["--straggler-action", "bogus", "--", sys.executable, SCRIPT], "'record' or 'restart'"),
        (["--bogus-flag", "--", sys.executable, SCRIPT], "bogus"),
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path, flags, needle):
    assert_usage_error(tmp_path / "r", flags, needle)


def test_auto_interval_measures_stall_persist_and_interference(tmp_path):
    # the later --checkpoint-every wins over the helper's fixed 5
    p = gpufleet_run(tmp_path, "--checkpoint-every", "auto", "--mtbf", "60", steps=40)
    assert p.returncode == 0, p.stderr[-3000:]
    decisions = evs(tmp_path, "interval")
    assert decisions and decisions[0]["policy"] == "auto"
    last = decisions[-1]
    assert last["model"] == "daly" and last["every_steps"] >= 1 and last["mtbf_s"] == 60
    # the stall and step time were measured in this run, and the persist interference is charged
    # (0 until enough clean and overlapped steps are seen; whether a persist commits before the last
    # decision depends on machine load, so persist_s is checked only when present)
    assert last["delta_s"] > 0 and last["step_s"] > 0
    assert all(d["interference_s"] >= 0 for d in decisions)
    assert last.get("persist_s") is None or last["persist_s"] > 0  # omitted from the line when None
    assert evs(tmp_path, "ckpt_committed") and evs(tmp_path, "run_end")[-1]["status"] == "completed"


def test_a_finished_run_directory_is_refused_and_fresh_starts_it_over(tmp_path):
    run_dir = tmp_path / "run"
    p = gpufleet_run(run_dir, steps=10, nproc=1)
    assert p.returncode == 0, p.stderr[-3000:]
    first = final(run_dir)
    ledger = (run_dir / "ledger.jsonl").read_bytes()
    # The same command again: refused before any worker starts, nothing recorded.
    p = gpufleet_run(run_dir, steps=10, nproc=1)
    assert p.returncode == 2, p.stderr[-3000:]
    assert p.stderr.strip() == (
        f"gpufleet: error: {run_dir} finished at step 10; nothing to train: use a new --run-dir, or --fresh"
    )
    assert (run_dir / "ledger.jsonl").read_bytes() == ledger
    assert len(list(run_dir.glob("final-*.json"))) == 1
    # --fresh: the previous run moves aside, whole, and the run trains again from step 0.
    p = gpufleet_run(run_dir, "--fresh", steps=10, nproc=1)
    assert p.returncode == 0, p.stderr[-3000:]
    (prev,) = run_dir.glob("previous-*")
    assert f"gpufleet: {run_dir}: starting fresh; moved the previous run to {prev}" in p.stderr
    assert (prev / "ledger.jsonl").read_bytes() == ledger
    assert (prev / "checkpoints" / "step_00000010" / "manifest.json").exists()
    restores = evs(run_dir, "restore")
    assert len(restores) == 1 and restores[0]["fresh"] and restores[0]["step"] == 0
    assert [e["status"] for e in evs(run_dir, "run_end")] == ["completed"]
    again = final(run_dir)
    assert again["steps"] == list(range(10)) and again["sha256"] == first["sha256"]

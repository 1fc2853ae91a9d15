"""A reused run directory never trains nothing in silence: `gpufleet run` refuses a finished one,
``--fresh`` sets the previous run aside (never deleting it), and a standalone run says where it resumes.
tests/integration/test_supervisor.py runs the whole sequence with real workers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import gpufleet
from gpufleet.checkpoint.storage.memory import keeper_dir
from gpufleet.core import events as E
from gpufleet.core.errors import OutputPathError, UsageError
from gpufleet.core.ledger import Ledger
from gpufleet.train.rundir import finished, plan_fresh, start_over
from gpufleet.train.settings import SupervisorConfig
from support.cli import assert_one_line_error, tree_snapshot
from support.cli import gpufleet as cli

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _session(
    run_dir: Path, end: E.RunStatus | None, steps: int = 40, start: int = 0, command: tuple[str, ...] = ()
) -> None:
    """One supervised session in RUN_DIR's ledger: restore at ``start``, steps to ``steps``, the final
    commit, and a ``run_end`` with status ``end`` (None: it never ended, as when the supervisor died)."""
    with Ledger(run_dir, session=f"s{start}-{end}") as led:
        led.emit(E.RunStart(world_size=2, backend="local", command=command))
        led.emit(E.Restore(step=start, load_s=0.01, fresh=start == 0))
        for s in range(start, steps):
            led.emit(E.Step(step=s, dt=0.01))
        led.emit(E.CkptCommitted(step=steps, path=str(run_dir / "checkpoints"), bytes=1, persist_s=0.0))
        if end is not None:
            led.emit(E.RunEnd(status=end, exit_code=0))


def _checkpoint(ckpt_dir: Path, step: int) -> Path:
    d = ckpt_dir / f"step_{step:08d}"
    d.mkdir(parents=True)
    (d / "manifest.json").write_text("{}")
    return d


def test_only_a_last_session_that_completed_is_finished(tmp_path: Path) -> None:
    assert finished(tmp_path / "none") is None  # no ledger
    done = tmp_path / "done"
    _session(done, E.RunStatus.COMPLETED)
    got = finished(done)
    assert got is not None and got.step == 40
    # resumed at the final checkpoint and trained nothing: still finished at that step
    _session(done, E.RunStatus.COMPLETED, steps=40, start=40)
    assert finished(done) == got
    for status in (
        E.RunStatus.INTERRUPTED,
        E.RunStatus.MAX_RESTARTS,
        E.RunStatus.NO_PROGRESS,
        E.RunStatus.CONFIG_ERROR,
        None,
    ):
        d = tmp_path / f"end-{status}"
        _session(d, E.RunStatus.COMPLETED, steps=20)
        _session(d, status, steps=30, start=20)  # the last session decides
        assert finished(d) is None, status


def test_gpufleet_run_refuses_a_finished_run_directory_before_any_worker(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    marker = tmp_path / "worker-ran"
    touch = f"import pathlib; pathlib.Path({str(marker)!r}).touch()"
    _session(run_dir, E.RunStatus.COMPLETED, command=(sys.executable, "-c", touch))
    before = (run_dir / "ledger.jsonl").read_bytes()
    r = cli("run", "--run-dir", run_dir, "--no-progress", "--", sys.executable, "-c", touch)
    assert_one_line_error(
        r, 2, f"{run_dir} finished at step 40; nothing to train: use a new --run-dir, or --fresh"
    )
    assert not marker.exists()
    assert (run_dir / "ledger.jsonl").read_bytes() == before  # nothing recorded
    assert sorted(p.name for p in run_dir.iterdir()) == ["ledger.jsonl"]


def test_another_command_on_a_finished_run_directory_may_train_on(tmp_path: Path) -> None:
    # It may ask for more steps, which only the script knows: the supervisor lets it resume (its
    # rank 0 says so when it has nothing to train; test_a_standalone_run_says_... shows the line).
    from gpufleet.train.supervisor import Supervisor

    run_dir = tmp_path / "run"
    _session(run_dir, E.RunStatus.COMPLETED, command=(sys.executable, "train.py", "--steps", "40"))
    cfg = SupervisorConfig(command=[sys.executable, "train.py", "--steps", "80"], run_dir=str(run_dir))
    Supervisor(cfg).backend.close()
    again = SupervisorConfig(command=[sys.executable, "train.py", "--steps", "40"], run_dir=str(run_dir))
    with pytest.raises(UsageError, match="finished at step 40; nothing to train"):
        Supervisor(again)


def test_bad_flags_with_fresh_move_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _session(run_dir, E.RunStatus.COMPLETED)
    _checkpoint(run_dir / "checkpoints", 40)
    before = tree_snapshot(tmp_path)
    r = cli("run", "--run-dir", run_dir, "--fresh", "-n", "0", "--", sys.executable, "-c", "pass")
    assert_one_line_error(r, 2, "nproc")
    assert tree_snapshot(tmp_path) == before


def _config(run_dir: Path) -> SupervisorConfig:
    return SupervisorConfig(command=[sys.executable, "-c", "pass"], run_dir=str(run_dir))


def test_fresh_moves_the_previous_run_aside_and_frees_its_memory_copies(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("GPUFLEET_MEMORY_TIER_DIR", str(tmp_path / "shm"))
    run_dir = tmp_path / "run"
    _session(run_dir, E.RunStatus.COMPLETED)
    _checkpoint(run_dir / "checkpoints", 40)
    (run_dir / "logs").mkdir()
    kept = keeper_dir(run_dir / "checkpoints")
    _checkpoint(kept, 40)  # a stale memory copy that a kill -9 of the supervisor left behind
    line = start_over(_config(run_dir))
    (prev,) = run_dir.glob("previous-*")
    assert line == f"{run_dir}: starting fresh; moved the previous run to {prev}"
    assert sorted(p.name for p in run_dir.iterdir()) == [prev.name]
    assert (prev / "checkpoints" / "step_00000040" / "manifest.json").exists()
    assert finished(prev) is not None and finished(run_dir) is None
    assert not kept.exists()
    # Again at once: a name of its own, and earlier previous-* directories stay where they are.
    _checkpoint(run_dir / "checkpoints", 5)
    plan = plan_fresh(run_dir, run_dir / "checkpoints", stamp=prev.name.removeprefix("previous-"))
    plan.apply()
    assert plan.into == run_dir / f"{prev.name}-2"
    assert sorted(p.name for p in run_dir.iterdir()) == [prev.name, f"{prev.name}-2"]
    assert (run_dir / f"{prev.name}-2" / "checkpoints" / "step_00000005").is_dir()
    # Nothing left to move: nothing moves.
    assert start_over(_config(run_dir)) == f"{run_dir}: starting fresh; nothing to set aside"


def test_fresh_moves_a_checkpoint_directory_outside_the_run_directory_beside_itself(
    tmp_path, monkeypatch
) -> None:
    ckpt = tmp_path / "ckpts"
    monkeypatch.setenv("GPUFLEET_CKPT_DIR", str(ckpt))
    run_dir = tmp_path / "run"
    _session(run_dir, E.RunStatus.COMPLETED)
    _checkpoint(ckpt, 40)
    line = start_over(_config(run_dir))
    (prev,) = run_dir.glob("previous-*")
    (moved,) = tmp_path.glob("ckpts.previous-*")
    assert line == f"{run_dir}: starting fresh; moved the previous run to {prev}, {moved}"
    assert not ckpt.exists() and (moved / "step_00000040" / "manifest.json").exists()
    # A checkpoint directory that holds the run directory cannot move: refused before anything moves.
    monkeypatch.setenv("GPUFLEET_CKPT_DIR", str(tmp_path))
    _session(run_dir, E.RunStatus.COMPLETED)
    with pytest.raises(OutputPathError, match="holds the run directory"):
        start_over(_config(run_dir))
    assert (run_dir / "ledger.jsonl").exists()


def _train(run_dir: Path, total: int) -> None:
    run = gpufleet.init(run_dir=str(run_dir), checkpoint_every="1000")
    model = torch.nn.Linear(2, 1)
    run.restore({"model": model})
    for _ in run.steps(total):
        run.log(loss=1.0)
    run.finish()


def test_a_standalone_run_says_where_it_starts_and_that_a_finished_one_has_nothing_to_train(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    _train(run_dir, 3)
    assert capsys.readouterr().err.splitlines() == [f"gpufleet: starting fresh in {run_dir}"]
    _train(run_dir, 3)
    assert capsys.readouterr().err.splitlines() == [
        f"gpufleet: resuming {run_dir} from step 3 (checkpoint {run_dir / 'checkpoints' / 'step_00000003'})",
        f"gpufleet: {run_dir} finished at step 3; nothing to train for steps(3): "
        "use a new GPUFLEET_RUN_DIR or init(run_dir=...)",
    ]
    _train(run_dir, 5)  # more steps: it trains on from the final checkpoint
    assert capsys.readouterr().err.splitlines() == [
        f"gpufleet: resuming {run_dir} from step 3 (checkpoint {run_dir / 'checkpoints' / 'step_00000003'})"
    ]

"""A run directory's past: whether its last session finished, and starting it over (``--fresh``).

``gpufleet run`` refuses a run directory whose last session completed: its workers would restore the
final checkpoint and train nothing, and a changed hyperparameter would go unnoticed. "Completed" is
the ledger's word (the last ``run_start``'s session ended with ``run_end`` status ``completed``), the
same one ``gpufleet report`` shows; a session that crashed, was stopped or used up its restarts is not
finished, and resumes. ``--fresh`` moves what the run directory holds aside (never deletes it) so the
run starts at step 0. Standard library and ``gpufleet.core`` only: the CLI calls it before anything
heavy is imported.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from gpufleet.core import events as E
from gpufleet.core.errors import ConfigError, OutputPathError
from gpufleet.core.ledger import iter_events

if TYPE_CHECKING:
    from gpufleet.train.settings import SupervisorConfig

__all__ = ["Finished", "FreshPlan", "finished", "nothing_to_train", "plan_fresh", "start_over"]

PREVIOUS = "previous-"
"""Prefix of the directories ``--fresh`` moves a run directory's contents into."""


@dataclass(frozen=True)
class Finished:
    """The last session of a run directory completed."""

    run_dir: str
    step: int
    """The step it finished at: the newest of its restore, steps and commits."""
    command: tuple[str, ...] = ()
    """Its training command, as its ``run_start`` recorded it."""


def finished(run_dir: str | os.PathLike[str]) -> Finished | None:
    """The run directory's last session, when its ledger says it completed; None otherwise (no ledger,
    a session still running, or one that crashed, was interrupted or gave up)."""
    status: str | None = None
    step = 0
    started = False
    command: tuple[str, ...] = ()
    for rec in iter_events(Path(run_dir)):
        kind = rec.get("ev")
        if kind == E.RunStart.kind:  # only the last session counts
            started, status, step = True, None, 0
            command = tuple(str(a) for a in rec.get("command") or ())
        elif kind == E.RunEnd.kind:
            status = str(rec.get("status"))
        elif kind in (E.Restore.kind, E.CkptCommitted.kind) and isinstance(rec.get("step"), int):
            step = max(step, rec["step"])
        elif kind == E.Step.kind and isinstance(rec.get("step"), int):
            step = max(step, rec["step"] + 1)
    if not started or status != E.RunStatus.COMPLETED:
        return None
    return Finished(run_dir=os.fspath(run_dir), step=step, command=command)


def nothing_to_train(done: Finished) -> str:
    """The one line ``gpufleet run`` prints for a finished run directory."""
    return f"{done.run_dir} finished at step {done.step}; nothing to train: use a new --run-dir, or --fresh"


@dataclass
class FreshPlan:
    """What ``--fresh`` moves, checked in full before anything moves (:func:`plan_fresh`)."""

    moves: list[tuple[Path, Path]] = field(default_factory=list)
    """(from, to) renames, each on one filesystem."""
    into: Path | None = None
    """The directory the run directory's contents go to."""

    def apply(self) -> None:
        """Do the moves, in order. Each is a rename: an entry is in its old place or its new one."""
        if self.into is not None:
            self.into.mkdir()
        for src, dst in self.moves:
            os.rename(src, dst)

    def describe(self) -> str:
        """One line for stderr: where the old run went."""
        if not self.moves:
            return "nothing to set aside"
        where = [str(self.into)] if self.into is not None else []
        where += [str(dst) for src, dst in self.moves if self.into is None or dst.parent != self.into]
        return "moved the previous run to " + ", ".join(where)


def plan_fresh(
    run_dir: str | os.PathLike[str], ckpt_dir: str | os.PathLike[str], *, stamp: str | None = None
) -> FreshPlan:
    """The moves that start ``run_dir`` over: everything in it except earlier ``previous-*`` directories
    into ``RUN_DIR/previous-STAMP/``; a checkpoint directory outside it to ``CKPT_DIR.previous-STAMP``
    beside it. Raises :class:`OutputPathError` (nothing moved) where a move could not be done."""
    run, ckpt = Path(run_dir), Path(ckpt_dir)
    stamp = stamp or time.strftime("%Y%m%d-%H%M%S")
    plan = FreshPlan()
    if run.is_dir():
        entries = sorted(p for p in run.iterdir() if not p.name.startswith(PREVIOUS))
        if entries:
            _writable(run)
            plan.into = _unused(run / f"{PREVIOUS}{stamp}")
            plan.moves += [(p, plan.into / p.name) for p in entries]
    elif run.exists():
        raise OutputPathError(run, "not a directory")
    if ckpt.exists() and not _inside(ckpt, run):
        if _inside(run, ckpt):
            raise OutputPathError(ckpt, "it holds the run directory; --fresh cannot move it")
        _writable(ckpt.parent)
        plan.moves.append((ckpt, _unused(ckpt.with_name(f"{ckpt.name}.{PREVIOUS}{stamp}"))))
    return plan


def _inside(path: Path, parent: Path) -> bool:
    return path.resolve().is_relative_to(parent.resolve())


def _writable(d: Path) -> None:
    if not os.access(d, os.W_OK | os.X_OK):
        raise OutputPathError(d, "not writable: --fresh cannot move the previous run aside")


def _unused(p: Path) -> Path:
    """``p``, or ``p-2``, ``p-3``... : a name nothing has (two starts within one second)."""
    n, out = 1, p
    while out.exists():
        n += 1
        out = p.with_name(f"{p.name}-{n}")
    return out


def start_over(config: SupervisorConfig) -> str:
    """``gpufleet run --fresh``: set the run directory's previous run aside, after checking every move;
    returns the line saying where it went.

    Every tier a restore reads must forget the old run. Local disk: its checkpoints move away. Memory
    (``--memory-tier``): restore only takes a memory copy that matches a commit on disk, so the moved
    commits are never restored from there; this node's copies are freed all the same. S3
    (``--upload``): a prefix that holds checkpoints would be restored from, and object storage is not
    moved: that is refused (use a new prefix) before anything moves."""
    run_dir = Path(config.run_dir)
    worker = config.worker
    ckpt_dir = Path(worker.checkpoint_dir) if worker.checkpoint_dir else run_dir / "checkpoints"
    plan = plan_fresh(run_dir, ckpt_dir)
    if worker.upload_url:
        from gpufleet.checkpoint.config import CheckpointConfig
        from gpufleet.checkpoint.storage import s3

        remote = s3.list_steps(
            CheckpointConfig(dir=str(ckpt_dir), upload_url=worker.upload_url, s3_endpoint=worker.s3_endpoint)
        )
        if remote:
            raise ConfigError(
                f"--fresh: {worker.upload_url} holds checkpoints (steps {min(remote)}-{max(remote)}) "
                "that the fresh run would restore, and gpufleet does not move object storage: "
                "use a new --upload prefix"
            )
    plan.apply()
    from gpufleet.checkpoint.storage.memory import release

    release(ckpt_dir)
    return f"{config.run_dir}: starting fresh; {plan.describe()}"

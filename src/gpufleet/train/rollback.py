"""What to do after a loss spike: replay once, then roll further back and skip the data.

A spike or NaN seen for the first time at step ``s`` is treated as transient (a flipped bit, a bad
node): restart from the newest checkpoint at or before ``s`` and replay the same batches, which keeps
training bit-identical to a run that never saw the fault. If it happens again at the same step, it is
caused by the data or the trajectory: roll back to a checkpoint at least ``window`` steps older, skip
every batch from there to ``s`` inclusive, and move the newer checkpoints of the bad trajectory to
``checkpoints/abandoned/`` (kept, never deleted) so a later restart cannot pick them up. Training
replays bit-identically, so a spike that recurs at the same step was reproduced by the data itself:
the ``skip`` rollback says so (``data_driven``), and the report tells it apart from a hardware fault.

The rollback budget is a rate, not a lifetime count: the run stops (exit 5) when more than
``max_rollbacks`` rollbacks fall within ``per_steps`` training steps of the newest one
(:meth:`RollbackPlanner.over_budget`). A run that keeps spiking dies quickly; a long healthy run
with an occasional data-driven spike never uses its budget up. ``per_steps=0`` counts the whole run.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

from gpufleet.core import events as E
from gpufleet.core.ledger import Ledger
from gpufleet.core.settings import RollbackPlan

__all__ = ["RollbackPlanner", "committed_steps"]

_STEP_DIR = re.compile(r"^step_(\d+)$")


def committed_steps(ckpt_dir: Path) -> list[int]:
    """Steps of the checkpoint directories that carry a manifest, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    out = []
    for p in ckpt_dir.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and (p / "manifest.json").is_file():
            out.append(int(m.group(1)))
    return sorted(out)


class RollbackPlanner:
    def __init__(self, run_dir: Path, window: int = 50) -> None:
        self.ckpt_dir = run_dir / "checkpoints"
        self.window = window
        self.count = 0
        self.steps: list[int] = []  # the spike step of every rollback, in order
        self.seen: dict[int, int] = {}
        self.skip: list[tuple[int, int]] = []
        self.max_step: int | None = None

    def pending(self) -> RollbackPlan:
        """The plan the next attempt's workers run with (restore bound and skip windows)."""
        return RollbackPlan(max_step=self.max_step, skip=tuple(self.skip))

    def clear_pending(self) -> None:
        self.max_step = None

    def plan(self, spike_step: int, ledger: Ledger, attempt: int) -> bool:
        """Decide the next attempt's restore bound and skip windows; always records a ``rollback`` event."""
        self.count += 1
        self.steps.append(spike_step)
        self.seen[spike_step] = self.seen.get(spike_step, 0) + 1
        steps = committed_steps(self.ckpt_dir)
        if self.seen[spike_step] == 1:
            self.max_step = spike_step
            target = max((s for s in steps if s <= spike_step), default=0)
            ledger.emit(
                E.Rollback(
                    from_step=spike_step,
                    to_step=target,
                    mode=E.RollbackMode.REPLAY,
                    attempt=attempt,
                    reason="first spike at this step: treated as transient, replaying the same batches",
                )
            )
            return True
        older = [s for s in steps if s <= spike_step - self.window]
        target = max(older) if older else 0
        abandoned = [s for s in steps if s > target]
        dest = self.ckpt_dir / "abandoned"
        for s in abandoned:
            dest.mkdir(parents=True, exist_ok=True)
            src = self.ckpt_dir / f"step_{s:08d}"
            shutil.move(str(src), str(dest / f"{src.name}.rollback{self.count}"))
        self.skip.append((target, spike_step + 1))
        self.max_step = target
        ledger.emit(
            E.Rollback(
                from_step=spike_step,
                to_step=target,
                mode=E.RollbackMode.SKIP,
                skip_from=target,
                skip_to=spike_step + 1,
                abandoned=tuple(abandoned),
                attempt=attempt,
                data_driven=True,
                reason="data-driven: the replay reproduced the spike at this step; skipping its batch window",
            )
        )
        return True

    def recent(self, per_steps: int) -> int:
        """Rollbacks whose spike step lies within ``per_steps`` steps of the newest one (0: all)."""
        if not self.steps:
            return 0
        last = self.steps[-1]
        return sum(1 for s in self.steps if per_steps == 0 or abs(last - s) < per_steps)

    def over_budget(self, max_rollbacks: int, per_steps: int) -> str | None:
        """Why the rollback budget is used up (the breaker's reason), or None while it is not."""
        n = self.recent(per_steps)
        if n <= max_rollbacks:
            return None
        where = f"within {per_steps} steps" if per_steps else "in this run"
        return f"more than {max_rollbacks} rollbacks {where} ({n}, the newest at step {self.steps[-1]})"

    def state(self) -> dict[str, Any]:
        return {"count": self.count, "steps": list(self.steps), "skip": [list(w) for w in self.skip]}

"""A synthetic-ledger builder: realistic event sequences with a controlled clock.

For tests, docs and benchmarks of the reliability math; it writes the same events, with the same
fields, as the supervisor and rank 0 do (see :mod:`gpufleet.core.events`). Every method advances
the clock ``t`` by the time the thing it records takes.

    b = LedgerBuilder()
    b.start(init_s=2.0)                 # run_start, attempt_start, worker_ready, restore(fresh)
    b.steps(5, dt=1.0)                  # steps 0..4
    b.checkpoint(stall_s=0.2, persist_s=1.0)   # next step carries the stall; then committed
    b.fail("crash", detect_s=0.5, teardown_s=1.0)
    b.recover(init_s=2.0, load_s=1.0)   # restart, attempt_start, worker_ready, restore(last commit)
    b.end("completed")
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["LedgerBuilder"]


class LedgerBuilder:
    def __init__(self, t0: float = 1_000_000.0, session: str = "s1", world_size: int = 2) -> None:
        self.t = t0
        self.mono0 = 50_000.0 - t0
        self.session = session
        self.world_size = world_size
        self.events: list[dict[str, Any]] = []
        self.attempt = -1
        self.next_step = 0  # index of the next step to run
        self.committed: int = 0  # newest committed resume step (0 = fresh)
        self._stall_next = 0.0

    # -- primitives -------------------------------------------------------------------------------

    def emit(self, ev: str, **fields: Any) -> dict[str, Any]:
        rec: dict[str, Any] = {"ev": ev, "t": self.t, "mono": self.t + self.mono0, "session": self.session}
        rec.update(fields)
        self.events.append(rec)
        return rec

    def wait(self, s: float) -> LedgerBuilder:
        self.t += s
        return self

    def new_session(self, session: str, gap_s: float = 100.0) -> LedgerBuilder:
        self.session = session
        self.t += gap_s
        self.attempt = -1
        return self

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self, init_s: float = 2.0, load_s: float = 0.0, resume: int | None = None) -> LedgerBuilder:
        """run_start, then the first attempt; restores ``resume`` (default: the newest commit)."""
        self.emit("run_start", world_size=self.world_size, nproc=self.world_size, backend="local")
        return self._attempt(init_s, load_s, self.committed if resume is None else resume)

    def _attempt(self, init_s: float, load_s: float, resume: int) -> LedgerBuilder:
        self.attempt += 1
        self.emit("attempt_start", attempt=self.attempt, world_size=self.world_size)
        self.t += init_s
        for r in range(self.world_size):
            self.emit("worker_ready", attempt=self.attempt, rank=r, init_s=init_s)
        self.t += load_s
        self.emit("restore", rank=0, step=resume, load_s=load_s, source="local", fresh=resume == 0)
        self.next_step = resume
        return self

    def steps(self, n: int, dt: float = 1.0, epoch: int = 0) -> LedgerBuilder:
        for _ in range(n):
            stall, self._stall_next = self._stall_next, 0.0
            self.t += dt + stall
            self.emit("step", rank=0, step=self.next_step, epoch=epoch, dt=dt + stall, stall=stall)
            self.next_step += 1
        return self

    def checkpoint(
        self, stall_s: float = 0.1, persist_s: float = 1.0, nbytes: int = 1 << 20, commit: bool = True
    ) -> LedgerBuilder:
        """Stage at the current boundary (the stall lands in the next step's dt); commit right away
        in the ledger (persist overlaps the following steps in reality)."""
        step = self.next_step
        self._stall_next = stall_s
        self.emit("ckpt_staged", rank=0, step=step, stall_s=stall_s, stage_s=stall_s, bytes=nbytes)
        if commit:
            self.emit("ckpt_committed", rank=0, step=step, bytes=nbytes, persist_s=persist_s, path=f"s{step}")
            self.committed = step
        else:
            self.emit("ckpt_failed", rank=0, step=step, reason="injected")
        return self

    def fail(
        self,
        cause: str = "crash",
        detect_s: float = 0.5,
        teardown_s: float = 1.0,
        rank: int = 1,
        lag_s: float = 0.0,
    ) -> LedgerBuilder:
        """The failure happens ``lag_s`` after the last event; detected ``detect_s`` later."""
        self.t += lag_s
        happened = self.t
        self.t += detect_s
        extra = {"exit_code": -9, "signal": 9} if cause == "crash" else {}
        self.emit("failure", cause=cause, rank=rank, step=self.next_step, happened_t=happened, **extra)
        self.emit("detected", cause=cause, detect_s=detect_s)
        self.t += teardown_s
        self.emit("teardown", attempt=self.attempt, teardown_s=teardown_s)
        return self

    def recover(self, init_s: float = 2.0, load_s: float = 1.0, rollback: bool = False) -> LedgerBuilder:
        self.emit("restart", attempt=self.attempt + 1, reason="failure")
        if rollback:
            self.emit(
                "rollback", rank=0, from_step=self.next_step - 1, to_step=self.committed, reason="spike"
            )
        return self._attempt(init_s, load_s, self.committed)

    def interval(self, **fields: Any) -> LedgerBuilder:
        self.emit("interval", rank=0, step=self.next_step, **fields)
        return self

    def end(self, status: str = "completed", exit_code: int = 0, after_s: float = 1.0) -> LedgerBuilder:
        self.t += after_s
        self.emit("run_end", status=status, exit_code=exit_code)
        return self

    # -- output -----------------------------------------------------------------------------------

    def write(self, run_dir: str | os.PathLike[str], torn_tail: bool = False) -> Path:
        p = Path(run_dir)
        p.mkdir(parents=True, exist_ok=True)
        path = p / "ledger.jsonl"
        with open(path, "w") as f:
            for e in self.events:
                f.write(json.dumps(e) + "\n")
            if torn_tail:
                f.write('{"ev":"step","t":')
        return path

"""A synthetic-ledger builder: realistic event sequences with a controlled clock.

For tests, docs and benchmarks of the reliability math. Every event is built through the typed
registry (:mod:`gpufleet.core.events`), so it carries exactly the fields the supervisor's and rank
0's events carry, in the order they emit them. Every method advances the clock ``t`` by the time the
thing it records takes.

    b = LedgerBuilder()
    b.start(init_s=2.0)                 # run_start, attempt_start, worker_ready, restore(fresh)
    b.steps(5, dt=1.0)                  # steps 0..4
    b.checkpoint(stall_s=0.2, persist_s=1.0)   # next step carries the stall; then committed
    b.fail("crash", detect_s=0.5, teardown_s=1.0)
    b.recover(init_s=2.0, load_s=1.0)   # restart, attempt_start, worker_ready, restore(last commit)
    b.fail("spike").recover(rollback="skip")   # spike; rollback (skip), restart; steps() skips it
    b.end("completed")
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from gpufleet.core import events as E

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
        self._failed_step = 0  # the step the last failure interrupted (a spike's step)
        self._skip: list[tuple[int, int]] = []  # batch windows [from, to) rank 0 skips

    # -- primitives -------------------------------------------------------------------------------

    def emit(self, ev: str, **fields: Any) -> dict[str, Any]:
        """Append one event of kind ``ev`` at the current clock (validated: unknown fields raise)."""
        env = {"t": self.t, "mono": self.t + self.mono0, "session": self.session}
        rec = E.make_event(ev, **(env | fields)).to_record()
        self.events.append(rec)
        return rec

    def _rank0(self, ev: str, **fields: Any) -> dict[str, Any]:
        """A rank-0 event as the supervisor relays it (rank and attempt stamped)."""
        return self.emit(ev, rank=0, attempt=self.attempt, **fields)

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

    def _attempt(self, init_s: float, load_s: float, resume: int, source: str = "local") -> LedgerBuilder:
        self.attempt += 1
        pids = [1000 + 10 * self.attempt + r for r in range(self.world_size)]
        self.emit("attempt_start", attempt=self.attempt, world_size=self.world_size, pids=pids)
        self.t += init_s
        for r in range(self.world_size):
            self.emit("worker_ready", attempt=self.attempt, rank=r, init_s=init_s)
        self.t += load_s
        if resume == 0:
            self._rank0("restore", step=0, load_s=load_s, fresh=True)
        else:
            self._rank0("restore", step=resume, load_s=load_s, source=source, path=f"s{resume}")
        self.next_step = resume
        return self

    def steps(self, n: int, dt: float = 1.0, epoch: int = 0) -> LedgerBuilder:
        """Run ``n`` steps; a step inside a skipped window is skipped (a ``skip`` event) first."""
        done = 0
        while done < n:
            window = next(((a, b) for a, b in self._skip if a <= self.next_step < b), None)
            if window is not None:
                self._rank0("skip", skipped_from=self.next_step, skipped_to=window[1])
                self.next_step = window[1]
                continue
            stall, self._stall_next = self._stall_next, 0.0
            self.t += dt + stall
            self._rank0("step", step=self.next_step, epoch=epoch, dt=dt + stall, stall=stall)
            self.next_step += 1
            done += 1
        return self

    def checkpoint(
        self, stall_s: float = 0.1, persist_s: float = 1.0, nbytes: int = 1 << 20, commit: bool = True
    ) -> LedgerBuilder:
        """Stage at the current boundary (the stall lands in the next step's dt); commit right away
        in the ledger (persist overlaps the following steps in reality)."""
        step = self.next_step
        self._stall_next = stall_s
        self._rank0("ckpt_staged", step=step, stall_s=stall_s, stage_s=stall_s, bytes=nbytes)
        if commit:
            self._rank0(
                "ckpt_committed", step=step, bytes=nbytes, persist_s=persist_s, path=f"s{step}", files=2
            )
            self.committed = step
        else:
            self._rank0("ckpt_failed", step=step, reason="injected")
        return self

    def fail(
        self,
        cause: str = "crash",
        detect_s: float = 0.5,
        teardown_s: float = 1.0,
        rank: int = 1,
        lag_s: float = 0.0,
        spike_value: float | None = 1e6,
        rejoin_s: float | None = None,
        abort_s: float = 0.0,
    ) -> LedgerBuilder:
        """The failure happens ``lag_s`` after the last event; detected ``detect_s`` later.

        A ``spike`` is preceded by rank 0's ``spike`` report for the step it happened at (its loss
        ``spike_value``; None for NaN). ``rejoin_s``: rank 0 survives in place; it noticed
        ``rejoin_s - abort_s`` after the failure and was ready to rejoin ``rejoin_s`` after it: before
        the supervisor's detection (a dead peer's socket usually tells it) or after (a hung peer's
        survivors notice once it is killed)."""
        self.t += lag_s
        happened = self.t
        self._failed_step = self.next_step
        if cause == E.FailureCause.SPIKE:
            self._rank0("spike", step=self.next_step, reason="loss spike", value=spike_value)
        if rejoin_s is not None:
            if not 0.0 <= abort_s <= rejoin_s:
                raise ValueError("need 0 <= abort_s <= rejoin_s")
            self.t += rejoin_s
            self.emit(
                "rejoin", rank=0, attempt=self.attempt + 1, reason="peer died", abort_s=abort_s, in_place=True
            )
            self.t -= rejoin_s
        self.t += detect_s
        extra = {"signal": 9, "detail": "killed by signal 9"} if cause == E.FailureCause.CRASH else {}
        self.emit(
            "failure",
            cause=cause,
            rank=rank,
            step=self.next_step - 1,  # the newest step rank 0 reported
            happened_t=happened,
            attempt=self.attempt,
            **extra,
        )
        self.emit("detected", cause=cause, detect_s=detect_s, attempt=self.attempt)
        self.t += teardown_s
        self.emit("teardown", attempt=self.attempt, teardown_s=teardown_s)
        return self

    def recover(
        self,
        init_s: float = 2.0,
        load_s: float = 1.0,
        rollback: bool | str = False,
        path: str = "full",
        source: str = "local",
    ) -> LedgerBuilder:
        """The supervisor's restart. ``rollback`` (after a spike): ``"replay"`` (or True) resumes at
        the newest commit and replays; ``"skip"`` also skips the window [newest commit, spike step]."""
        spike = self._failed_step
        if rollback in (True, E.RollbackMode.REPLAY):
            self.emit(
                "rollback", from_step=spike, to_step=self.committed, mode="replay", attempt=self.attempt
            )
        elif rollback == E.RollbackMode.SKIP:
            window = (self.committed, spike + 1)
            self._skip.append(window)
            self.emit(
                "rollback",
                from_step=spike,
                to_step=self.committed,
                mode="skip",
                skip_from=window[0],
                skip_to=window[1],
                data_driven=True,
                attempt=self.attempt,
            )
        elif rollback:
            raise ValueError(f"rollback must be False, True, 'replay' or 'skip', not {rollback!r}")
        self.emit("restart", attempt=self.attempt + 1, reason="failure", path=path)
        return self._attempt(init_s, load_s, self.committed, source)

    def interval(self, **fields: Any) -> LedgerBuilder:
        self._rank0("interval", step=self.next_step, **fields)
        return self

    def end(self, status: str = "completed", exit_code: int = 0, after_s: float = 1.0) -> LedgerBuilder:
        self.t += after_s
        self.emit("run_end", status=status, exit_code=exit_code, restarts=max(self.attempt, 0))
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

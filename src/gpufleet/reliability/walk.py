"""Replays a ledger into sessions, step executions and failure incidents (pure functions, no I/O).

The rules (the formulas built on them are in docs/reliability.md):

* A **session** starts at each ``run_start``; events before the first one (a standalone run) form
  a session of their own. Within a session events are ordered by wall time ``t`` (stable), so a
  worker event relayed late is still placed where it happened.
* A **step execution** is one ``step`` event: work = ``dt − stall``, it started at ``t − dt``.
* A ``restore`` with ``step = k`` rolls back every earlier execution of a step ≥ k that is still
  live, in any attempt or earlier session: that work is wasted (recompute). A second execution of
  an index that is still live (a restore event missing) also supersedes the first.
* An **incident** opens at a ``failure`` event when none is open. It closes at the first step
  completed after a restore (or after a new attempt began). Further failures while it is open are
  *secondary* if they come from the same attempt (one incident, e.g. the other ranks' exits);
  failures of a later attempt during the recovery are counted but extend the same incident.
  An incident still open when its session ends is unrecovered.
* Incident time points: happened (``happened_t``, else ``t − detected.detect_s``, else ``t``) →
  detected (failure ``t``) → teardown end (last ``teardown`` ``t``) → load start (``restore.t −
  load_s``) → restored (``restore.t``) → first step (its ``t``). MTTR and its phases are the
  differences, so the phases sum to MTTR exactly.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["StepExec", "Incident", "Session", "Walk", "walk"]


def _f(x: Any, default: float = 0.0) -> float:
    """A finite float from an event field, or ``default``."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return default
    v = float(x)
    return v if v == v and abs(v) != float("inf") else default


@dataclass
class StepExec:
    step: int
    t: float  # wall time the step finished
    dt: float
    stall: float
    session: int
    attempt: int
    wasted: bool = False

    @property
    def work(self) -> float:
        return max(self.dt - self.stall, 0.0)

    @property
    def start(self) -> float:
        return self.t - self.dt


@dataclass
class Incident:
    cause: str
    session: int
    attempt: int
    rank: int | None
    step: int | None
    t_happen: float
    t_detect: float
    detect_s: float | None = None
    t_teardown_end: float | None = None
    t_load_start: float | None = None
    t_restore: float | None = None
    t_first_step: float | None = None
    restore_step: int | None = None
    failures: int = 1  # failures counted in this incident (not secondary)
    secondary: int = 0
    lost_steps: int = 0
    recompute_s: float = 0.0
    t_end: float | None = None  # session end, for an unrecovered incident

    @property
    def recovered(self) -> bool:
        return self.t_first_step is not None

    def phases(self) -> dict[str, float]:
        """detect / teardown / spawn_init / load / first_step, seconds (recovered incidents)."""
        td = self.t_teardown_end if self.t_teardown_end is not None else self.t_detect
        td = max(td, self.t_detect)
        out = {"detect": max(self.t_detect - self.t_happen, 0.0), "teardown": td - self.t_detect}
        if self.t_first_step is None or self.t_load_start is None or self.t_restore is None:
            return out | {"spawn_init": 0.0, "load": 0.0, "first_step": 0.0}
        ls = max(self.t_load_start, td)
        rs = max(self.t_restore, ls)
        out["spawn_init"] = ls - td
        out["load"] = rs - ls
        out["first_step"] = max(self.t_first_step - rs, 0.0)
        return out

    @property
    def mttr(self) -> float | None:
        return sum(self.phases().values()) if self.recovered else None

    @property
    def downtime(self) -> float:
        end = self.t_first_step if self.t_first_step is not None else self.t_end
        return max((end if end is not None else self.t_detect) - self.t_happen, 0.0)


@dataclass
class Session:
    index: int
    id: str | None
    start: float
    end: float
    status: str | None = None
    exit_code: int | None = None
    attempts: int = 0
    restarts: int = 0
    spawn_init_s: float = 0.0  # startup spawn/init of attempts that were not recoveries
    startup_load_s: float = 0.0

    @property
    def wall(self) -> float:
        return max(self.end - self.start, 0.0)


@dataclass
class Walk:
    sessions: list[Session] = field(default_factory=list)
    steps: list[StepExec] = field(default_factory=list)
    incidents: list[Incident] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)  # counted failure events
    restores: list[dict[str, Any]] = field(default_factory=list)
    rollbacks: list[dict[str, Any]] = field(default_factory=list)  # rollback decisions (to_step)
    skips: list[dict[str, Any]] = field(default_factory=list)  # skipped batch windows
    worker_ready: list[dict[str, Any]] = field(default_factory=list)
    by_ev: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    load_s: float = 0.0  # every restore's load_s

    def events(self, ev: str) -> list[dict[str, Any]]:
        return self.by_ev.get(ev, [])


def _split_sessions(events: Iterable[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    groups: list[list[dict[str, Any]]] = []
    cur: list[dict[str, Any]] = []
    for e in events:
        if e.get("ev") == "run_start" and cur:
            groups.append(cur)
            cur = []
        cur.append(e)
    if cur:
        groups.append(cur)
    return groups


class _Walker:
    def __init__(self) -> None:
        self.w = Walk()
        self.live: dict[int, StepExec] = {}

    def roll_back(self, k: int, inc: Incident | None) -> None:
        for idx in [i for i in self.live if i >= k]:
            ex = self.live.pop(idx)
            ex.wasted = True
            if inc is not None:
                inc.lost_steps += 1
                inc.recompute_s += ex.work

    def session(self, si: int, evs: list[dict[str, Any]]) -> None:
        evs = sorted(evs, key=lambda e: _f(e.get("t")))
        ts = [_f(e.get("t")) for e in evs]
        first = evs[0]
        start = ts[0]
        if first.get("ev") != "run_start":  # standalone: the first step began before its event
            starts = [_f(e.get("t")) - _f(e.get("dt")) for e in evs if e.get("ev") == "step"]
            start = min([start, *starts])
        sess = Session(index=si, id=first.get("session"), start=start, end=max(ts))
        self.w.sessions.append(sess)
        attempt = 0
        attempt_origin = start  # where the current attempt's spawn/init began
        attempt_has_step = False
        attempt_load_start: float | None = None
        inc: Incident | None = None
        for e in evs:
            ev = str(e.get("ev"))
            t = _f(e.get("t"))
            self.w.by_ev.setdefault(ev, []).append(e)
            if ev == "attempt_start":
                attempt = int(_f(e.get("attempt"), attempt + 1))
                sess.attempts += 1
                attempt_has_step, attempt_load_start = False, None
                if inc is None:
                    attempt_origin = start if sess.attempts == 1 else t
            elif ev == "worker_ready":
                self.w.worker_ready.append(e)
            elif ev == "restart":
                sess.restarts += 1
            elif ev == "failure":
                if inc is not None and inc.attempt == attempt:
                    inc.secondary += 1
                    continue
                self.w.failures.append(e)
                if inc is not None:
                    inc.failures += 1
                    continue
                happened = e.get("happened_t")
                rank, step = e.get("rank"), e.get("step")
                inc = Incident(
                    cause=str(e.get("cause", "unknown")),
                    session=si,
                    attempt=attempt,
                    rank=int(rank) if isinstance(rank, int) else None,
                    step=int(step) if isinstance(step, int) else None,
                    t_happen=_f(happened, t) if happened is not None else t,
                    t_detect=t,
                )
                inc.t_happen = min(inc.t_happen, t)
                self.w.incidents.append(inc)
            elif ev == "detected":
                if inc is not None and inc.detect_s is None and inc.t_first_step is None:
                    inc.detect_s = max(_f(e.get("detect_s")), 0.0)
                    if inc.t_happen == inc.t_detect:
                        inc.t_happen = inc.t_detect - inc.detect_s
            elif ev == "teardown":
                if inc is not None:
                    inc.t_teardown_end = t
            elif ev == "restore":
                self.w.restores.append(e)
                load = max(_f(e.get("load_s")), 0.0)
                self.w.load_s += load
                k = int(_f(e.get("step"), 0))
                self.roll_back(k, inc)
                if inc is not None:
                    inc.t_load_start, inc.t_restore, inc.restore_step = t - load, t, k
                elif not attempt_has_step:
                    sess.startup_load_s += load
                    if attempt_load_start is None:
                        attempt_load_start = t - load
            elif ev == "rollback":
                # The supervisor's decision carries to_step; a rank's spike report (from_step only)
                # and a skipped batch window (skipped_from/skipped_to) are kept apart.
                if "to_step" in e:
                    self.w.rollbacks.append(e)
                elif "skipped_from" in e:
                    self.w.skips.append(e)
            elif ev == "step":
                ex = StepExec(
                    step=int(_f(e.get("step"), -1)),
                    t=t,
                    dt=max(_f(e.get("dt")), 0.0),
                    stall=max(_f(e.get("stall")), 0.0),
                    session=si,
                    attempt=int(e["attempt"]) if isinstance(e.get("attempt"), int) else attempt,
                )
                prev = self.live.get(ex.step)
                if prev is not None:
                    self.roll_back(ex.step, inc)
                self.live[ex.step] = ex
                self.w.steps.append(ex)
                if inc is not None and (inc.t_restore is not None or attempt != inc.attempt):
                    if inc.t_restore is None:
                        inc.t_load_start = inc.t_restore = max(ex.start, inc.t_detect)
                    inc.t_first_step = t
                    inc = None
                elif inc is None and not attempt_has_step:
                    origin_end = attempt_load_start if attempt_load_start is not None else ex.start
                    sess.spawn_init_s += max(origin_end - attempt_origin, 0.0)
                attempt_has_step = True
            elif ev == "run_end":
                sess.status = e.get("status")
                code = e.get("exit_code")
                sess.exit_code = int(code) if isinstance(code, int) else None
        if inc is not None:
            inc.t_end = sess.end


def walk(events: Iterable[dict[str, Any]]) -> Walk:
    """Replay ledger events (file order) into a :class:`Walk`."""
    w = _Walker()
    for si, evs in enumerate(_split_sessions(events)):
        w.session(si, evs)
    return w.w

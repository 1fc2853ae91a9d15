"""Replays a ledger into sessions, step executions and failure incidents (pure functions, no I/O).

Raw records are typed first (:func:`gpufleet.core.events.parse_event`, lenient): a line this
version cannot type (an unknown kind from a newer writer, or fields that do not fit) is skipped, and
the walk dispatches on the event classes.

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
* A **rollback** is the supervisor's ``rollback`` decision; a **skipped window** is a ``skip``
  event rank 0 emits when it jumps over the batch window a ``skip`` rollback decided. The same window
  skipped again (after a later restart from before it) counts once.
* A **loss-spike alarm** is the first ``spike`` event at a step (per session). Its kind: *injected*
  when a ``nan``/``spike`` drill fired at that step in that attempt; its outcome: *data-driven* when a
  later ``spike`` at the same step shows the replay reproduced it (*identical* when the two values
  are equal), *transient* when a later ``step`` event completes that step without one, else
  *unresolved*. A *false alarm* is a data-driven alarm on a finite loss that no drill injected
  (docs/reliability.md, "Loss spikes").
* Incident time points: happened (``happened_t``, else ``t − detected.detect_s``, else ``t``) →
  detected (failure ``t``) → teardown end (last ``teardown`` ``t``) → load start (``restore.t −
  load_s``) → restored (``restore.t``) → first step (its ``t``). MTTR and its phases are the
  differences, so the phases sum to MTTR exactly.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from gpufleet.core import events as E

__all__ = ["StepExec", "Incident", "SpikeAlarm", "Session", "Walk", "walk", "typed"]

_Ev = TypeVar("_Ev", bound=E.Event)


def _f(x: Any, default: float = 0.0) -> float:
    """A finite float, or ``default`` (None, NaN and infinities from a garbled ledger)."""
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
    path: str = "full"  # the restart's path (restart.path): full, or in_process
    abort_s: float | None = None  # in-process: the slowest survivor's abort (rejoin.abort_s)
    t_rejoin: float | None = None  # in-process: the last survivor ready to rejoin (rejoin.t)
    restore_source: str | None = None  # where the recovery's restore read the state (restore.source)

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

    def in_place_phases(self) -> dict[str, float] | None:
        """An in-process recovery's critical path (None for any other incident), cut where its events
        fall: ``supervisor`` (failure → the supervisor detected it and stopped the lost rank), ``abort``
        (→ the last survivor left the round, where that came later: a hung peer's survivors notice
        only once it is killed; a dead one's usually before the supervisor does), ``rendezvous``
        (→ the restore began: the new round, its groups re-formed), ``restore``, ``first_step``.
        They sum to :attr:`mttr`; the survivors' own abort time is ``abort_s``."""
        if self.path != "in_process" or self.t_first_step is None or self.t_restore is None:
            return None
        ph = self.phases()
        b_torn = self.t_happen + ph["detect"] + ph["teardown"]
        b_load = b_torn + ph["spawn_init"]
        b_left = min(max(self.t_rejoin if self.t_rejoin is not None else b_torn, b_torn), b_load)
        return {
            "supervisor": b_torn - self.t_happen,
            "abort": b_left - b_torn,
            "rendezvous": b_load - b_left,
            "restore": ph["load"],
            "first_step": ph["first_step"],
        }

    def rejoined(self, e: E.Rejoin) -> None:
        """A survivor of this incident left the round: the failure happened no later than it noticed
        (its ``t`` less its ``abort_s``), which may be before the supervisor saw the process die."""
        abort = max(_f(e.abort_s), 0.0)
        self.abort_s = max(self.abort_s or 0.0, abort)
        self.t_rejoin = max(self.t_rejoin or e.t, e.t)
        self.t_happen = min(self.t_happen, e.t - abort)

    @property
    def mttr(self) -> float | None:
        return sum(self.phases().values()) if self.recovered else None

    @property
    def downtime(self) -> float:
        end = self.t_first_step if self.t_first_step is not None else self.t_end
        return max((end if end is not None else self.t_detect) - self.t_happen, 0.0)


@dataclass
class SpikeAlarm:
    """The loss guard fired at ``step`` (its first ``spike`` event there) and what the replay showed."""

    session: int
    attempt: int
    step: int
    value: float | None  # the mean loss (None: NaN or inf)
    reason: str
    injected: bool = False  # a nan/spike drill fired at this step
    outcome: str = "unresolved"  # transient | data_driven | unresolved
    replay_value: float | None = None  # data_driven: the loss the replay saw
    identical: bool = False  # data_driven: the replay saw exactly the same value

    @property
    def false_alarm(self) -> bool:
        """Reproduced by the replay (so the machine computed it right), finite, and not a drill."""
        return self.outcome == "data_driven" and self.value is not None and not self.injected


@dataclass
class Session:
    index: int
    id: str | None
    start: float
    end: float
    status: str | None = None  # a RunStatus (a plain str when a newer writer used a value unknown here)
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
    failures: list[E.Failure] = field(default_factory=list)  # counted failures (secondary ones excluded)
    restores: list[E.Restore] = field(default_factory=list)
    rollbacks: list[E.Rollback] = field(default_factory=list)  # the supervisor's rollback decisions
    skips: list[E.Skip] = field(default_factory=list)  # every skip event (a window may repeat)
    alarms: list[SpikeAlarm] = field(default_factory=list)  # loss-spike alarms, one per session and step
    worker_ready: list[E.WorkerReady] = field(default_factory=list)
    by_kind: dict[type[E.Event], list[E.Event]] = field(default_factory=dict)
    load_s: float = 0.0  # every restore's load_s

    def events(self, kind: type[_Ev]) -> list[_Ev]:
        """Every event of one class, in walk order (time order within each session)."""
        return self.by_kind.get(kind, [])  # type: ignore[return-value]

    @property
    def skipped_windows(self) -> list[tuple[int, int]]:
        """Distinct skipped batch windows [from, to), in the order first skipped."""
        return list(dict.fromkeys((s.skipped_from, s.skipped_to) for s in self.skips))


def typed(events: Iterable[Mapping[str, Any] | E.Event]) -> list[E.Event]:
    """Events typed (raw records parsed leniently), without the ones this version cannot type."""
    out = []
    for e in events:
        ev = e if isinstance(e, E.Event) else E.parse_event(e)
        if not isinstance(ev, E.UnknownEvent) and ev.t == ev.t:
            out.append(ev)
    return out


def _split_sessions(events: list[E.Event]) -> list[list[E.Event]]:
    groups: list[list[E.Event]] = []
    cur: list[E.Event] = []
    for e in events:
        if isinstance(e, E.RunStart) and cur:
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

    def session(self, si: int, evs: list[E.Event]) -> None:
        evs = sorted(evs, key=lambda e: e.t)
        first = evs[0]
        start = evs[0].t
        if not isinstance(first, E.RunStart):  # standalone: the first step began before its event
            start = min([start, *(e.t - _f(e.dt) for e in evs if isinstance(e, E.Step))])
        sess = Session(index=si, id=first.session, start=start, end=evs[-1].t)
        self.w.sessions.append(sess)
        attempt = 0
        attempt_origin = start  # where the current attempt's spawn/init began
        attempt_has_step = False
        attempt_load_start: float | None = None
        inc: Incident | None = None
        early_rejoins: list[E.Rejoin] = []  # rejoins relayed before their failure's event
        drills: set[tuple[int, int]] = set()  # (attempt, step) where a nan/spike drill fired
        alarms: dict[int, SpikeAlarm] = {}  # step -> this session's alarm there
        for e in evs:
            t = e.t
            self.w.by_kind.setdefault(type(e), []).append(e)
            match e:
                case E.AttemptStart():
                    attempt = e.attempt if e.attempt is not None else attempt + 1
                    sess.attempts += 1
                    attempt_has_step, attempt_load_start = False, None
                    if inc is None:
                        attempt_origin = start if sess.attempts == 1 else t
                case E.WorkerReady():
                    self.w.worker_ready.append(e)
                case E.Restart():
                    sess.restarts += 1
                    if inc is not None:
                        inc.path = str(e.path)
                case E.Rejoin():
                    if inc is not None:
                        inc.rejoined(e)
                    else:  # a survivor saw its peer die before the supervisor did
                        early_rejoins.append(e)
                case E.Failure():
                    if inc is not None and inc.attempt == attempt:
                        inc.secondary += 1
                        continue
                    self.w.failures.append(e)
                    if inc is not None:
                        inc.failures += 1
                        continue
                    inc = Incident(
                        cause=str(e.cause),
                        session=si,
                        attempt=attempt,
                        rank=e.rank,
                        step=e.step,
                        t_happen=min(_f(e.happened_t, t), t),
                        t_detect=t,
                    )
                    for r in early_rejoins:
                        if r.attempt is None or r.attempt == attempt + 1:
                            inc.rejoined(r)
                    early_rejoins.clear()
                    self.w.incidents.append(inc)
                case E.Detected():
                    if inc is not None and inc.detect_s is None and inc.t_first_step is None:
                        inc.detect_s = max(_f(e.detect_s), 0.0)
                        if inc.t_happen == inc.t_detect:
                            inc.t_happen = inc.t_detect - inc.detect_s
                case E.Teardown():
                    if inc is not None:
                        inc.t_teardown_end = t
                case E.Restore():
                    self.w.restores.append(e)
                    load = max(_f(e.load_s), 0.0)
                    self.w.load_s += load
                    self.roll_back(e.step, inc)
                    if inc is not None:
                        inc.t_load_start, inc.t_restore, inc.restore_step = t - load, t, e.step
                        inc.restore_source = str(e.source) if e.source is not None else None
                    elif not attempt_has_step:
                        sess.startup_load_s += load
                        if attempt_load_start is None:
                            attempt_load_start = t - load
                case E.Rollback():
                    self.w.rollbacks.append(e)
                case E.Skip():
                    self.w.skips.append(e)
                case E.Inject():
                    if e.fault in ("nan", "spike"):
                        drills.add((e.attempt if e.attempt is not None else attempt, e.step))
                case E.Spike():
                    at = e.attempt if e.attempt is not None else attempt
                    value = e.value if e.value is None else _f(e.value, float("nan"))
                    value = None if value != value else value
                    alarm = alarms.get(e.step)
                    if alarm is None:
                        alarm = SpikeAlarm(si, at, e.step, value, e.reason, injected=(at, e.step) in drills)
                        alarms[e.step] = alarm
                        self.w.alarms.append(alarm)
                    elif alarm.outcome == "unresolved":
                        alarm.outcome, alarm.replay_value = "data_driven", value
                        alarm.identical = value == alarm.value
                case E.Step():
                    ex = StepExec(
                        step=e.step,
                        t=t,
                        dt=max(_f(e.dt), 0.0),
                        stall=max(_f(e.stall), 0.0),
                        session=si,
                        attempt=e.attempt if e.attempt is not None else attempt,
                    )
                    alarm = alarms.get(ex.step)
                    if alarm is not None and alarm.outcome == "unresolved":
                        alarm.outcome = "transient"
                    if ex.step in self.live:
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
                case E.RunEnd():
                    sess.status = str(e.status)
                    sess.exit_code = e.exit_code
        if inc is not None:
            inc.t_end = sess.end


def walk(events: Iterable[Mapping[str, Any] | E.Event]) -> Walk:
    """Replay ledger events (file order; raw records or typed events) into a :class:`Walk`."""
    w = _Walker()
    for si, evs in enumerate(_split_sessions(typed(events))):
        w.session(si, evs)
    return w.w

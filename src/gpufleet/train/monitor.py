"""Reads an attempt's event channel and turns it into heartbeats, progress and relayed ledger events."""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from gpufleet.backends.base import Attempt
from gpufleet.core import events as E
from gpufleet.core.ledger import Ledger
from gpufleet.train.straggler import StragglerConfig, StragglerDetector

__all__ = ["AttemptMonitor"]

# Events every rank sends that the ledger keeps; all others are kept from rank 0 only.
_ALL_RANKS = (E.WorkerReady, E.Inject, E.Rejoin)
# A rank whose script has returned (an ``exit`` heartbeat) is only exiting: the teardown of torch and
# its communicators takes seconds on a loaded host. It is hung only when that takes longer than this
# (or than the init timeout); a crash on the way out still shows in its exit status.
EXIT_TIMEOUT_S = 120.0


@dataclass
class AttemptMonitor:
    run: Attempt  # the backend's handle on the attempt: its workers and their event channel
    ledger: Ledger
    attempt: int
    hang_floor_s: float
    init_timeout_s: float
    hang_multiplier: float = 10.0
    last_hb: dict[int, float] = field(default_factory=dict)  # rank -> monotonic time of last heartbeat
    last_hb_wall: dict[int, float] = field(default_factory=dict)
    phase: dict[int, str] = field(default_factory=dict)
    hb_step: dict[int, int] = field(default_factory=dict)  # rank -> step of its last heartbeat
    step: int = -1
    total: int | None = None
    loss: float | None = None
    ready: set[int] = field(default_factory=set)
    spike_step: int | None = None
    spike_t: float | None = None  # wall time the loss guard fired (the failure's true start)
    fired: list[E.Inject] = field(default_factory=list)
    committed_step: int = -1
    rejoined: dict[int, bool] = field(default_factory=dict)  # rank -> left its round in place (rejoin)
    config_error: str | None = None  # a worker's gpufleet.init() rejected its settings: the message
    step_times: deque[float] = field(default_factory=lambda: deque(maxlen=200))
    started: float = field(default_factory=time.monotonic)
    first_heard: float | None = None  # monotonic time the first rank of this attempt was heard from
    stragglers: StragglerConfig | None = field(default_factory=StragglerConfig)  # None: do not look
    straggler: E.Straggler | None = None  # the first straggler flagged in this attempt
    _unknown: set[str] = field(default_factory=set)  # kinds of worker events that could not be typed
    _detector: StragglerDetector | None = None
    _tail: float | None = None  # the slow tail of step_times, kept until the next step event

    def pump(self, timeout: float) -> None:
        """Take in whatever the workers sent within ``timeout`` seconds."""
        for rec in self.run.events.read(timeout):
            self._handle(rec)

    @property
    def expected_ranks(self) -> list[int]:
        return [r for w in self.run.workers for r in w.ranks]

    def _handle(self, rec: dict[str, Any]) -> None:
        rank = int(rec["rank"])  # the channel names it (a node agent's carries several ranks)
        if rec.get("ev") == "config_error":  # the worker's last words before exit 78; not a ledger event
            self.config_error = self.config_error or str(rec.get("message", ""))
            return
        event = E.parse_event(rec)
        now = time.monotonic()
        if self.first_heard is None and isinstance(event, E.Heartbeat | E.WorkerReady):
            self.first_heard = now
        if isinstance(event, E.Heartbeat):
            self.last_hb[rank] = now
            self.last_hb_wall[rank] = event.t
            self.phase[rank] = str(event.phase or "step")
            self.hb_step[rank] = event.step
            if event.total is not None:
                self.total = event.total
            if event.work is not None:
                self._timings(rank, event)
            return
        if isinstance(event, E.UnknownEvent):
            self._ignore(event.ev, event.problem)
            return
        if isinstance(event, E.WorkerReady):
            self.ready.add(rank)
            self.last_hb[rank] = now
            self.last_hb_wall[rank] = event.t
            self.phase[rank] = "init"
        elif isinstance(event, E.Step):
            self.step = event.step
            if event.loss is not None:
                self.loss = event.loss
            self.step_times.append(event.dt)
            self._tail = None
        elif isinstance(event, E.Spike):
            self.spike_step = event.step
            self.spike_t = event.t
        elif isinstance(event, E.Inject):
            self.fired.append(event)
        elif isinstance(event, E.CkptCommitted):
            self.committed_step = max(self.committed_step, event.step)
        elif isinstance(event, E.Rejoin):
            self.rejoined[rank] = event.in_place
        if event.in_ledger and (rank == 0 or isinstance(event, _ALL_RANKS)):
            try:
                # A rejoin names the attempt the rank rejoins (it leaves this one)
                attempt = self.attempt + 1 if isinstance(event, E.Rejoin) else self.attempt
                self.ledger.emit(dataclasses.replace(event, rank=rank, attempt=attempt))
            except E.EventSchemaError as e:  # read leniently, but the ledger only takes valid events
                self._ignore(event.kind, str(e))

    def _timings(self, rank: int, hb: E.Heartbeat) -> None:
        if self.stragglers is None:
            return
        if self._detector is None:
            self._detector = StragglerDetector(sorted(self.expected_ranks), self.stragglers)
        nodes = {r: w.node for w in self.run.workers for r in w.ranks}
        for found in self._detector.observe(rank, hb.step, hb.work, hb.fwd):
            assert found.rank is not None
            event = dataclasses.replace(found, attempt=self.attempt, node=nodes.get(found.rank))
            self.ledger.emit(event)
            self.straggler = self.straggler or event
            where = f" on {event.node}" if event.node else ""
            print(
                f"gpufleet: rank {event.rank}{where} is a straggler: {event.section} {event.seconds:.3g} s "
                f"per step against {event.peers_s:.3g} s for its peers ({event.ratio:.2f}x)",
                file=sys.stderr,
            )

    def _ignore(self, kind: str, why: str) -> None:
        """A worker event that cannot be typed: say so once per kind, and never let it stop the run."""
        if kind not in self._unknown:
            self._unknown.add(kind)
            print(f"gpufleet: ignoring a worker event ({why})", file=sys.stderr)

    def injected_at(self, rank: int, kind: str) -> float | None:
        """Wall time a drill fault of ``kind`` fired on ``rank`` in this attempt (when it really failed)."""
        times = [f.t for f in self.fired if f.fault == kind and f.rank == rank]
        return max(times) if times else None

    def hang_timeout(self, rank: int) -> float:
        """Auto-calibrated: ``multiplier`` x the slow tail of observed step times, never below the floor."""
        if self.phase.get(rank) == "exit":
            return max(self.init_timeout_s, self.hang_floor_s, EXIT_TIMEOUT_S)
        if self.phase.get(rank, "init") not in ("step", "sync") or len(self.step_times) < 3:
            return max(self.init_timeout_s, self.hang_floor_s)
        if self._tail is None:  # checked on every supervisor wake-up: computed once per step event
            self._tail = (
                statistics.quantiles(self.step_times, n=100)[98]
                if len(self.step_times) >= 10
                else max(self.step_times)
            )
        return max(self.hang_floor_s, self.hang_multiplier * self._tail)

    def hung_rank(self, codes: dict[int, int | None]) -> tuple[int, float] | None:
        """If any live rank is silent past its timeout: the rank to blame and when it was last heard from.

        Peers of a hung rank block in the next collective, so they fall silent too. The culprit is the
        rank furthest behind: lowest heartbeat step, then not waiting in a collective ("sync"), then
        silent longest. ``codes``: the attempt's :meth:`~gpufleet.backends.base.Attempt.poll`.

        Until one rank of the attempt has been heard from (``worker_ready`` or a step heartbeat), none
        is hung: a script that reports no steps (no ``gpufleet.init()``, no optimizer step yet) is
        watched by its exit status only. Once one has, a rank never heard from has the init timeout
        from that moment on: the script reports, so its silent ranks should too.
        """
        if self.first_heard is None:
            return None
        now = time.monotonic()
        since = max(self.started, self.first_heard)
        live = [r for w in self.run.workers if codes.get(w.rank) is None for r in w.ranks]
        if not any(now - self.last_hb.get(r, since) > self.hang_timeout(r) for r in live):
            return None

        def behind(r: int) -> tuple[int, int, float]:
            return (
                self.hb_step.get(r, -1),
                int(self.phase.get(r) == "sync"),
                self.last_hb.get(r, since),
            )

        culprit = min(live, key=behind)
        last = self.last_hb.get(culprit, since)
        return culprit, self.last_hb_wall.get(culprit, time.time() - (now - last))

"""What the exporter exports: run directories, the fleet ledger and serve-bench directories.

Each source turns files into samples of the metrics in :data:`SPECS` (names, types, help, labels).
Numbers come from the functions ``gpufleet report`` (:mod:`gpufleet.reliability.metrics`) and
``gpufleet nodes`` (:mod:`gpufleet.health.nodes`) use, over the same events, so the exporter and the
report agree by construction. Ledgers are read incrementally (:class:`~gpufleet.observe.tail.LedgerTail`);
histograms and counters of single events grow with each new line, and the walk-derived numbers
(goodput, badput, MTTR, MTBF, restarts) are recomputed only when new events arrived.

Naming (docs/observability.md): a ``gpufleet_`` prefix, base units (seconds, bytes, ratios),
``_total`` on counters. Labels are bounded: run and bench names (one per directory), node names,
check names, and closed sets (causes, phases, states, outcomes). Never a step number, a reason text,
a command line or a configuration value.

Goodput and badput are *gauges* of seconds, not counters: a rollback reclassifies productive time
as recompute, so the productive seconds of a run can go down, and a counter must never do that.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from gpufleet.core import events as E
from gpufleet.core.ledger import LEDGER_NAME
from gpufleet.observe.tail import LedgerTail

__all__ = [
    "Spec",
    "SPECS",
    "Sample",
    "Hist",
    "Source",
    "RunSource",
    "FleetSource",
    "ServeSource",
    "Sources",
    "RUN_STATES",
    "HEALTH_STATUSES",
]

Kind = Literal["gauge", "counter", "histogram"]


@dataclass(frozen=True, slots=True)
class Spec:
    """One metric: its full name (counters end in ``_total``), type, help text and label names."""

    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...] = ()  # histograms: upper bounds, +Inf implied


STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
STALL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
PERSIST_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)

DERIVE_BACKOFF = 20.0  # the walk-derived numbers take at most 1/20 of a core (RunSource.refresh)
DERIVE_CHEAP_S = 0.05  # a walk quicker than this runs at every scrape that has new events
RUN_STATES = ("running", *(s.value for s in E.RunStatus))
CAUSES = tuple(c.value for c in E.FailureCause)
MODES = tuple(m.value for m in E.RollbackMode)
HEALTH_STATUSES = ("OK", "WARN", "FAIL", "INCOMPLETE")
CKPT_OUTCOMES = ("staged", "committed", "failed", "skipped", "uploaded", "verified", "deleted",
                 "restore_rejected")  # fmt: skip
R = ("run",)


def _specs(*specs: Spec) -> dict[str, Spec]:
    return {s.name: s for s in specs}


SPECS: dict[str, Spec] = _specs(
    # ---- a training run (one run directory)
    Spec("gpufleet_run_running", "gauge", "1 while the run's newest session has not ended.", R),
    Spec(
        "gpufleet_run_status",
        "gauge",
        "1 for the run's current status (running or how it ended).",
        ("run", "status"),
    ),  # fmt: skip
    Spec("gpufleet_run_sessions_total", "counter", "gpufleet run invocations in this run directory.", R),
    Spec("gpufleet_run_attempt", "gauge", "The current (newest) attempt of the newest session.", R),
    Spec("gpufleet_run_world_size", "gauge", "Ranks in the newest attempt.", R),
    Spec("gpufleet_run_last_event_timestamp_seconds", "gauge", "Wall time of the newest ledger event.", R),
    Spec(
        "gpufleet_train_last_progress_timestamp_seconds",
        "gauge",
        "Wall time of the newest completed step (the session start before the first).",
        R,
    ),  # fmt: skip
    Spec("gpufleet_train_steps_total", "counter", "Step executions (replayed steps count again).", R),
    Spec("gpufleet_train_steps_rolled_back_total", "counter", "Step executions thrown away by a restore.", R),
    Spec("gpufleet_train_last_step", "gauge", "Index of the newest productive step.", R),
    Spec(
        "gpufleet_train_step_duration_seconds",
        "histogram",
        "Wall time of one step, stall included.",
        R,
        STEP_BUCKETS,
    ),  # fmt: skip
    Spec("gpufleet_train_wall_seconds", "gauge", "Wall time of all sessions (the goodput denominator).", R),
    Spec(
        "gpufleet_train_time_seconds",
        "gauge",
        "Wall time by category: productive, and the badput categories; they sum to the wall time.",
        ("run", "category"),
    ),  # fmt: skip
    Spec("gpufleet_train_goodput_ratio", "gauge", "Productive step time / wall time (gpufleet report).", R),
    Spec(
        "gpufleet_train_failures_total",
        "counter",
        "Counted failures by cause (secondary excluded).",
        ("run", "cause"),
    ),  # fmt: skip
    Spec(
        "gpufleet_train_restarts_total",
        "counter",
        "Restarts by the cause that made them necessary.",
        ("run", "cause"),
    ),  # fmt: skip
    Spec(
        "gpufleet_train_rollbacks_total", "counter", "Loss-spike rollback decisions by mode.", ("run", "mode")
    ),
    Spec("gpufleet_train_spikes_total", "counter", "Loss-spike alarms (one per session and step).", R),
    Spec("gpufleet_train_unrecovered_failures", "gauge", "Failure incidents without a recovery.", R),
    Spec("gpufleet_train_recoveries_total", "counter", "Recovered failure incidents.", R),
    Spec("gpufleet_train_mtbf_seconds", "gauge", "Mean time between failures (uptime / failures).", R),
    Spec("gpufleet_train_mttr_seconds", "gauge", "Mean time to recovery over recovered incidents.", R),
    Spec(
        "gpufleet_train_mttr_phase_seconds",
        "gauge",
        "Mean of each MTTR phase over recovered incidents.",
        ("run", "phase"),
    ),  # fmt: skip
    Spec(
        "gpufleet_checkpoint_stall_seconds",
        "histogram",
        "Training time blocked by one checkpoint.",
        R,
        STALL_BUCKETS,
    ),  # fmt: skip
    Spec(
        "gpufleet_checkpoint_persist_seconds",
        "histogram",
        "Stage end to commit of one checkpoint.",
        R,
        PERSIST_BUCKETS,
    ),  # fmt: skip
    Spec("gpufleet_checkpoints_total", "counter", "Checkpoint events by outcome.", ("run", "outcome")),
    Spec("gpufleet_checkpoint_committed_bytes_total", "counter", "Bytes of committed checkpoints.", R),
    Spec("gpufleet_checkpoint_last_committed_step", "gauge", "Step of the newest committed checkpoint.", R),
    Spec("gpufleet_checkpoint_last_commit_timestamp_seconds", "gauge", "Wall time of the newest commit.", R),
    Spec(
        "gpufleet_checkpoint_last_failure_timestamp_seconds",
        "gauge",
        "Wall time of the newest failed checkpoint (absent: none failed).",
        R,
    ),  # fmt: skip
    # ---- the fleet ledger: node states and health results
    Spec(
        "gpufleet_node_state",
        "gauge",
        "1 for the node's current state (the fleet ledger).",
        ("node", "state"),
    ),
    Spec(
        "gpufleet_node_state_since_timestamp_seconds",
        "gauge",
        "When the node entered its current state.",
        ("node", "state"),
    ),  # fmt: skip
    Spec(
        "gpufleet_node_state_info",
        "gauge",
        "Why the node is in its state: the part blamed, who changed it, the health check behind it.",
        ("node", "component", "by", "check"),
    ),  # fmt: skip
    Spec(
        "gpufleet_node_failures_total",
        "counter",
        "Node failures by the component blamed.",
        ("node", "component"),
    ),  # fmt: skip
    Spec(
        "gpufleet_node_lemon", "gauge", "1 when the node failed too often within the lemon window.", ("node",)
    ),
    Spec("gpufleet_node_mtbf_seconds", "gauge", "Time in good states / failures, per node.", ("node",)),
    Spec("gpufleet_node_mttr_seconds", "gauge", "Mean repair time, per node.", ("node",)),
    Spec(
        "gpufleet_health_check_status",
        "gauge",
        "1 for the status of the newest result of a check.",
        ("node", "check", "device", "status"),
    ),  # fmt: skip
    Spec(
        "gpufleet_health_check_value",
        "gauge",
        "The measured value of the newest result, in its unit.",
        ("node", "check", "device", "unit"),
    ),  # fmt: skip
    Spec(
        "gpufleet_health_check_timestamp_seconds",
        "gauge",
        "When the newest result was recorded.",
        ("node", "check", "device"),
    ),  # fmt: skip
    Spec(
        "gpufleet_health_check_valid_until_timestamp_seconds",
        "gauge",
        "When the newest result expires.",
        ("node", "check", "device"),
    ),  # fmt: skip
    Spec(
        "gpufleet_health_check_duration_seconds",
        "gauge",
        "How long the newest run of the check took.",
        ("node", "check", "device"),
    ),  # fmt: skip
    Spec(
        "gpufleet_health_results_total", "counter", "Health results recorded, by status.", ("node", "status")
    ),
    Spec(
        "gpufleet_node_actions_total",
        "counter",
        "Node isolations and releases gpufleet decided (Slurm, Kubernetes, Ray), by result.",
        ("platform", "action", "result"),
    ),
    Spec("gpufleet_breaker_open_total", "counter", "Isolations the circuit breaker refused.", ("platform",)),
    Spec(
        "gpufleet_operator_actions_total",
        "counter",
        "Operator actions requested (MCP), by action and result.",
        ("action", "result"),
    ),  # fmt: skip
    # ---- serve-bench summaries and capacity curves
    Spec(
        "gpufleet_serve_bench_timestamp_seconds", "gauge", "When the newest summary was written.", ("bench",)
    ),
    Spec(
        "gpufleet_serve_latency_seconds",
        "gauge",
        "Latency percentiles of the newest summary.",
        ("bench", "metric", "percentile"),
    ),  # fmt: skip
    Spec("gpufleet_serve_slo_limit_seconds", "gauge", "The SLO's latency limits.", ("bench", "metric")),
    Spec("gpufleet_serve_slo_attainment_ratio", "gauge", "Share of requests meeting every SLO.", ("bench",)),
    Spec(
        "gpufleet_serve_slo_target_ratio", "gauge", "The attainment the capacity search aimed at.", ("bench",)
    ),
    Spec(
        "gpufleet_serve_goodput_requests_per_second",
        "gauge",
        "Requests per second meeting every SLO.",
        ("bench",),
    ),  # fmt: skip
    Spec(
        "gpufleet_serve_throughput_requests_per_second", "gauge", "Completed requests per second.", ("bench",)
    ),
    Spec("gpufleet_serve_offered_requests_per_second", "gauge", "The offered request rate.", ("bench",)),
    Spec("gpufleet_serve_output_tokens_per_second", "gauge", "Output tokens per second.", ("bench",)),
    Spec(
        "gpufleet_serve_requests", "gauge", "Requests of the newest summary by outcome.", ("bench", "outcome")
    ),
    Spec("gpufleet_serve_valid", "gauge", "1 when the client kept up (the summary is valid).", ("bench",)),
    Spec(
        "gpufleet_serve_capacity_max_rate_requests_per_second",
        "gauge",
        "The highest rate meeting the target attainment (capacity.json).",
        ("bench",),
    ),  # fmt: skip
    Spec(
        "gpufleet_serve_capacity_attainment_ratio",
        "gauge",
        "Attainment at each offered rate measured.",
        ("bench", "offered_rate"),
    ),  # fmt: skip
    Spec(
        "gpufleet_serve_capacity_goodput_requests_per_second",
        "gauge",
        "Goodput at each offered rate.",
        ("bench", "offered_rate"),
    ),  # fmt: skip
    # ---- the exporter itself
    Spec("gpufleet_exporter_sources", "gauge", "Sources this exporter reads, by kind.", ("kind",)),
    Spec(
        "gpufleet_exporter_collect_seconds", "gauge", "How long reading the sources took at this scrape.", ()
    ),
)


@dataclass(slots=True)
class Hist:
    """A histogram grown one observation at a time (counts per bucket, not cumulative)."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, x: float) -> None:
        if not math.isfinite(x):
            return
        i = next((k for k, b in enumerate(self.bounds) if x <= b), len(self.bounds))
        self.counts[i] += 1
        self.total += x

    def cumulative(self) -> list[tuple[str, float]]:
        out, acc = [], 0
        for b, c in zip((*self.bounds, math.inf), self.counts, strict=True):
            acc += c
            out.append(("+Inf" if b == math.inf else _fmt_bound(b), float(acc)))
        return out


def _fmt_bound(b: float) -> str:
    return repr(float(b))


@dataclass(frozen=True, slots=True)
class Sample:
    """One sample: a metric of :data:`SPECS`, its label values (in the spec's order), a value."""

    name: str
    labels: tuple[str, ...]
    value: float | Hist


class Source:
    """A thing that yields samples; ``refresh()`` reads what changed since the last scrape."""

    kind: str = ""

    def refresh(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def samples(self) -> Iterator[Sample]:  # pragma: no cover - interface
        raise NotImplementedError


def _num(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    v = float(x)
    return v if math.isfinite(v) else None


# ---------------------------------------------------------------------------------- runs
class RunSource(Source):
    """One run directory's ledger, read incrementally; numbers as ``gpufleet report --json``."""

    kind = "run"

    def __init__(self, run_dir: str | os.PathLike[str], name: str) -> None:
        self.dir = Path(run_dir)
        self.name = name
        self.tail = LedgerTail(self.dir / LEDGER_NAME)
        self._gen = -1
        self._derived: dict[str, Any] = {}
        self._dirty = False  # events arrived that the derived numbers do not include yet
        self._derive_cost = 0.0  # seconds the last walk took
        self._derive_at = 0.0  # when (monotonic) it ran
        self._reset()

    def _reset(self) -> None:
        self.step_hist = Hist(STEP_BUCKETS)
        self.stall_hist = Hist(STALL_BUCKETS)
        self.persist_hist = Hist(PERSIST_BUCKETS)
        self.last_commit_t: float | None = None
        self.last_fail_t: float | None = None
        self.last_t: float | None = None
        self.progress_t: float | None = None
        self.sessions = 0
        self.attempt = 0
        self.world_size: int | None = None
        self.running = False
        self.status: str | None = None
        self._derived = {}

    def refresh(self) -> None:
        new = self.tail.poll()
        if self.tail.generation != self._gen:  # first read, or the file was replaced: start over
            self._gen = self.tail.generation
            self._reset()
            new = list(self.tail.events)
        for e in new:
            self._observe(e)
        self._dirty = self._dirty or bool(new)
        # The walk covers the whole history. When it costs more than DERIVE_CHEAP_S (a long live
        # run), recompute it at most every DERIVE_BACKOFF times its own cost, so it never takes more
        # than 1/DERIVE_BACKOFF of a core in the process it shares (the supervisor's, with
        # --metrics). Counters and histograms of single events above are exact at every scrape; the
        # walk-derived numbers of a run of 100k steps lag by some seconds.
        now = time.monotonic()
        cheap = self._derive_cost < DERIVE_CHEAP_S
        if self._dirty and (cheap or now - self._derive_at >= DERIVE_BACKOFF * self._derive_cost):
            self._derived = derive(self.tail.events)
            self._dirty = False
            self._derive_at = time.monotonic()
            self._derive_cost = self._derive_at - now

    @property
    def derived(self) -> dict[str, Any]:
        """The walk-derived numbers of the last refresh (:func:`derive`)."""
        return self._derived

    def _observe(self, e: E.Event) -> None:
        t = _num(e.t)
        if t is not None and (self.last_t is None or t > self.last_t):
            self.last_t = t
        match e:
            case E.Step():
                self.step_hist.observe(float(e.dt))
                if t is not None and (self.progress_t is None or t > self.progress_t):
                    self.progress_t = t
            case E.CkptStaged():
                self.stall_hist.observe(float(e.stall_s))
            case E.CkptCommitted():
                self.persist_hist.observe(float(e.persist_s))
                self.last_commit_t = max(self.last_commit_t or 0.0, e.t)
            case E.CkptFailed():
                self.last_fail_t = max(self.last_fail_t or 0.0, e.t)
            case E.RunStart():
                self.sessions += 1
                self.running, self.status = True, "running"
                self.attempt, self.world_size = 0, e.world_size
                if self.progress_t is None or e.t > self.progress_t:
                    self.progress_t = e.t
            case E.AttemptStart():
                self.attempt = e.attempt if e.attempt is not None else self.attempt + 1
                self.world_size = e.world_size
            case E.RunEnd():
                self.running, self.status = False, str(e.status)
            case _:
                pass

    def samples(self) -> Iterator[Sample]:
        r = (self.name,)
        if not self.tail.events:
            return
        d = self._derived
        status = self.status or ("running" if self.running else "")
        yield Sample("gpufleet_run_running", r, float(self.running))
        for s in RUN_STATES:
            yield Sample("gpufleet_run_status", (self.name, s), float(s == status))
        yield Sample("gpufleet_run_sessions_total", r, float(self.sessions))
        yield Sample("gpufleet_run_attempt", r, float(self.attempt))
        if self.world_size is not None:
            yield Sample("gpufleet_run_world_size", r, float(self.world_size))
        if self.last_t is not None:
            yield Sample("gpufleet_run_last_event_timestamp_seconds", r, self.last_t)
        if self.progress_t is not None:
            yield Sample("gpufleet_train_last_progress_timestamp_seconds", r, self.progress_t)
        yield Sample("gpufleet_train_step_duration_seconds", r, self.step_hist)
        yield Sample("gpufleet_checkpoint_stall_seconds", r, self.stall_hist)
        yield Sample("gpufleet_checkpoint_persist_seconds", r, self.persist_hist)
        if self.last_commit_t is not None:
            yield Sample("gpufleet_checkpoint_last_commit_timestamp_seconds", r, self.last_commit_t)
        if self.last_fail_t is not None:
            yield Sample("gpufleet_checkpoint_last_failure_timestamp_seconds", r, self.last_fail_t)
        for key, value in d.get("scalars", {}).items():
            if value is not None:
                yield Sample(key, r, float(value))
        for key, per in d.get("labelled", {}).items():
            for label, value in per.items():
                if value is not None:
                    yield Sample(key, (self.name, label), float(value))


def derive(events: Sequence[E.Event]) -> dict[str, Any]:
    """The walk-derived numbers of a run, with the functions ``gpufleet report --json`` uses."""
    from gpufleet.reliability.metrics import (
        BADPUT_CATEGORIES,
        PHASES,
        badput,
        checkpoint_stats,
        failures_by_cause,
        mtbf,
        mttr,
        wall_time,
    )
    from gpufleet.reliability.walk import walk

    w = walk(events)
    wall = wall_time(w)
    bp = badput(w)
    m, _uptime, _n = mtbf(w)
    mt = mttr(w)
    ck = checkpoint_stats(w)
    by_cause = failures_by_cause(w)
    restarts = Counter(_closed(e.reason, CAUSES) for e in w.events(E.Restart))
    rollbacks = Counter(_closed(str(e.mode), MODES) for e in w.rollbacks)
    done = [x for x in w.steps if not x.wasted]
    committed = ck["committed"]
    return {
        "scalars": {
            "gpufleet_train_steps_total": len(w.steps),
            "gpufleet_train_steps_rolled_back_total": len(w.steps) - len(done),
            "gpufleet_train_last_step": max((x.step for x in done), default=None),
            "gpufleet_train_wall_seconds": wall,
            "gpufleet_train_goodput_ratio": bp["productive"] / wall if wall > 0 else None,
            "gpufleet_train_spikes_total": len(w.alarms),
            "gpufleet_train_unrecovered_failures": sum(1 for i in w.incidents if not i.recovered),
            "gpufleet_train_recoveries_total": mt["count"],
            "gpufleet_train_mtbf_seconds": m,
            "gpufleet_train_mttr_seconds": mt["mean_s"],
            "gpufleet_checkpoint_committed_bytes_total": ck["bytes_committed_total"],
            "gpufleet_checkpoint_last_committed_step": ck["last_committed_step"],
        },
        "labelled": {
            "gpufleet_train_time_seconds": {k: bp[k] for k in ("productive", *BADPUT_CATEGORIES)},
            "gpufleet_train_failures_total": {
                c: by_cause.get(c, 0) for c in dict.fromkeys((*CAUSES, *by_cause))
            },
            "gpufleet_train_restarts_total": {
                c: restarts.get(c, 0) for c in dict.fromkeys((*CAUSES, *restarts))
            },
            "gpufleet_train_rollbacks_total": {
                m_: rollbacks.get(m_, 0) for m_ in dict.fromkeys((*MODES, *rollbacks))
            },
            "gpufleet_train_mttr_phase_seconds": {p: mt["phases_mean_s"][p] for p in PHASES},
            "gpufleet_checkpoints_total": {o: ck[o] for o in CKPT_OUTCOMES} | {"committed": committed},
        },
    }


def _closed(value: str, allowed: Sequence[str]) -> str:
    """A label value from a closed set; anything else (free text from a newer writer) is "other"."""
    return value if value in allowed else "other"


# ---------------------------------------------------------------------------------- fleet
class FleetSource(Source):
    """The fleet ledger: node states and reputation (as ``gpufleet nodes``), health results."""

    kind = "fleet"

    def __init__(self, fleet_dir: str | os.PathLike[str]) -> None:
        self.dir = Path(fleet_dir)
        self.tail = LedgerTail(self.dir / LEDGER_NAME)
        self._gen = -1
        self._reset()

    def _reset(self) -> None:
        self.states: dict[str, list[dict[str, Any]]] = {}
        self.latest: dict[tuple[str, str, str], E.HealthResult] = {}
        self.results: Counter[tuple[str, str]] = Counter()
        self.node_actions: Counter[tuple[str, str, str]] = Counter()
        self.breaker: Counter[str] = Counter()
        self.actions: Counter[tuple[str, str]] = Counter()

    def refresh(self) -> None:
        new = self.tail.poll()
        if self.tail.generation != self._gen:
            self._gen = self.tail.generation
            self._reset()
            new = list(self.tail.events)
        for e in new:
            match e:
                case E.NodeState():
                    self.states.setdefault(e.node, []).append(E.to_record(e))
                case E.HealthResult():
                    key = (e.node, e.check, e.device or "")
                    old = self.latest.get(key)
                    if old is None or old.t <= e.t:
                        self.latest[key] = e
                    self.results[(e.node, _closed(e.status, HEALTH_STATUSES))] += 1
                case E.NodeAction():
                    self.node_actions[(str(e.platform), str(e.action), str(e.result))] += 1
                    if e.hit is not None:
                        self.breaker[str(e.platform)] += 1
                case E.OperatorAction():
                    self.actions[(str(e.action), str(e.result))] += 1
                case _:
                    pass
        for evs in self.states.values():
            evs.sort(key=lambda r: float(r.get("t", 0.0)))

    def samples(self) -> Iterator[Sample]:
        from gpufleet.health.nodes import COMPONENTS, STATES, lemon_settings, summarize_node

        n, window_s = lemon_settings()
        now = time.time()
        for node, evs in sorted(self.states.items()):
            s = summarize_node(node, evs, now=now, lemon_failures=n, lemon_window_s=window_s)
            last = evs[-1]
            for st in STATES:
                yield Sample("gpufleet_node_state", (node, st), float(st == s.state))
            yield Sample("gpufleet_node_state_since_timestamp_seconds", (node, s.state), s.since)
            comp = _closed(str(last.get("component", "unknown")), COMPONENTS)
            check = str(last.get("check") or "")
            yield Sample("gpufleet_node_state_info", (node, comp, s.by, check), 1.0)
            for c in COMPONENTS:
                yield Sample(
                    "gpufleet_node_failures_total", (node, c), float(s.failures_by_component.get(c, 0))
                )
            yield Sample("gpufleet_node_lemon", (node,), float(s.lemon))
            if s.mtbf_s is not None:
                yield Sample("gpufleet_node_mtbf_seconds", (node,), s.mtbf_s)
            if s.mttr_s is not None:
                yield Sample("gpufleet_node_mttr_seconds", (node,), s.mttr_s)
        for (node, check, device), r in sorted(self.latest.items()):
            status = _closed(r.status, HEALTH_STATUSES)
            for st in HEALTH_STATUSES:
                yield Sample("gpufleet_health_check_status", (node, check, device, st), float(st == status))
            if (v := _num(r.value)) is not None:
                yield Sample("gpufleet_health_check_value", (node, check, device, r.unit), v)
            yield Sample("gpufleet_health_check_timestamp_seconds", (node, check, device), r.t)
            yield Sample("gpufleet_health_check_valid_until_timestamp_seconds", (node, check, device),
                         r.valid_until)  # fmt: skip
            yield Sample("gpufleet_health_check_duration_seconds", (node, check, device), r.duration_s)
        for (node, st), c in sorted(self.results.items()):
            yield Sample("gpufleet_health_results_total", (node, st), float(c))
        for (platform, a, res), c in sorted(self.node_actions.items()):
            yield Sample("gpufleet_node_actions_total", (platform, a, res), float(c))
        for platform, c in sorted(self.breaker.items()):
            yield Sample("gpufleet_breaker_open_total", (platform,), float(c))
        for (a, res), c in sorted(self.actions.items()):
            yield Sample("gpufleet_operator_actions_total", (a, res), float(c))


# ---------------------------------------------------------------------------------- serving
SUMMARY, CAPACITY = "summary.json", "capacity.json"


def newest(directory: Path, name: str) -> Path | None:
    """``directory/name`` if present, else the newest ``*/name`` below it (not under ``levels/``)."""
    direct = directory / name
    if direct.is_file():
        return direct
    found = [p for p in directory.glob(f"*/{name}") if p.is_file()]
    return max(found, key=lambda p: p.stat().st_mtime, default=None)


class ServeSource(Source):
    """The newest serve-bench summary and capacity curve in a directory (re-read when they change)."""

    kind = "serve"

    def __init__(self, directory: str | os.PathLike[str], name: str) -> None:
        self.dir = Path(directory)
        self.name = name
        self._files: dict[str, tuple[Path, float, dict[str, Any]]] = {}

    def refresh(self) -> None:
        for fname in (SUMMARY, CAPACITY):
            p = newest(self.dir, fname)
            if p is None:
                self._files.pop(fname, None)
                continue
            try:
                mtime = p.stat().st_mtime
                cached = self._files.get(fname)
                if cached and cached[0] == p and cached[1] == mtime:
                    continue
                data = json.loads(p.read_text())
            except (OSError, ValueError):
                continue  # being rewritten; the next scrape reads it
            if isinstance(data, dict):
                self._files[fname] = (p, mtime, data)

    def samples(self) -> Iterator[Sample]:
        b = (self.name,)
        if SUMMARY in self._files:
            yield from self._summary(self._files[SUMMARY][2], b)
        if CAPACITY in self._files:
            cap = self._files[CAPACITY][2]
            if (v := _num(cap.get("target_attainment"))) is not None:
                yield Sample("gpufleet_serve_slo_target_ratio", b, v)
            if (v := _num(cap.get("max_rate"))) is not None:
                yield Sample("gpufleet_serve_capacity_max_rate_requests_per_second", b, v)
            for p in cap.get("points") or ():
                rate = _num(p.get("offered_rate"))
                if rate is None:
                    continue
                lab = (self.name, f"{rate:.4g}")
                if (a := _num(p.get("attainment"))) is not None:
                    yield Sample("gpufleet_serve_capacity_attainment_ratio", lab, a)
                if (g := _num(p.get("goodput_per_s"))) is not None:
                    yield Sample("gpufleet_serve_capacity_goodput_requests_per_second", lab, g)

    def _summary(self, s: dict[str, Any], b: tuple[str, ...]) -> Iterator[Sample]:
        def get(*path: str) -> Any:
            x: Any = s
            for k in path:
                x = x.get(k) if isinstance(x, dict) else None
            return x

        if (t := _num(s.get("created_unix"))) is not None:
            yield Sample("gpufleet_serve_bench_timestamp_seconds", b, t)
        for metric, pct in (get("latency_ms") or {}).items():
            if metric not in ("ttft", "tpot", "itl", "e2e") or not isinstance(pct, dict):
                continue
            for key in ("p50", "p90", "p99"):
                if (v := _num(pct.get(key))) is not None:
                    yield Sample("gpufleet_serve_latency_seconds", (self.name, metric, key), v / 1000.0)
        for key, ms in (get("slo", "limits_ms") or {}).items():
            if (v := _num(ms)) is not None and key in ("ttft", "tpot", "itl", "e2e"):
                yield Sample("gpufleet_serve_slo_limit_seconds", (self.name, key), v / 1000.0)
        for name, path in (
            ("gpufleet_serve_slo_attainment_ratio", ("slo", "attainment")),
            ("gpufleet_serve_goodput_requests_per_second", ("slo", "goodput_per_s")),
            ("gpufleet_serve_throughput_requests_per_second", ("rate", "request_throughput_per_s")),
            ("gpufleet_serve_offered_requests_per_second", ("rate", "offered_per_s")),
            ("gpufleet_serve_output_tokens_per_second", ("tokens", "output_throughput_per_s")),
        ):
            if (v := _num(get(*path))) is not None:
                yield Sample(name, b, v)
        for outcome in ("ok", "failed", "good"):
            if (v := _num(get("requests", outcome))) is not None:
                yield Sample("gpufleet_serve_requests", (self.name, outcome), v)
        if isinstance(s.get("valid"), bool):
            yield Sample("gpufleet_serve_valid", b, float(s["valid"]))


# ---------------------------------------------------------------------------------- the set
class Sources:
    """Every source of one exporter. Directories given as roots are searched again at each refresh.

    A directory holding ``ledger.jsonl`` is a run; one holding ``summary.json`` or ``capacity.json``
    is a serve-bench directory; any other directory is a root whose child directories are runs or
    serve-bench directories (new ones are picked up at the next scrape).
    """

    def __init__(
        self,
        dirs: Iterable[str | os.PathLike[str]] = (),
        *,
        runs: Iterable[str | os.PathLike[str]] = (),
        fleet_dir: str | os.PathLike[str] | None = None,
        serve_dirs: Iterable[str | os.PathLike[str]] = (),
    ) -> None:
        self.dirs = [Path(d) for d in dirs]
        self.runs = [Path(d) for d in runs]  # run directories, even before their ledger exists
        self.serve_dirs = [Path(d) for d in serve_dirs]
        self.fleet = FleetSource(fleet_dir) if fleet_dir is not None else None
        self._by_path: dict[Path, Source] = {}
        self._names: set[tuple[str, str]] = set()
        self.last_collect_s = 0.0

    def _name(self, kind: str, p: Path) -> str:
        name = p.name or str(p)
        if (kind, name) in self._names:
            name = f"{p.parent.name}/{p.name}"
            k = 2
            while (kind, name) in self._names:
                name, k = f"{p.parent.name}/{p.name}#{k}", k + 1
        self._names.add((kind, name))
        return name

    def _add(self, p: Path, kind: str) -> None:
        key = p.resolve()
        if key in self._by_path:
            return
        src: Source
        if kind == "run":
            src = RunSource(p, self._name("run", p))
        else:
            src = ServeSource(p, self._name("serve", p))
        self._by_path[key] = src

    def discover(self) -> None:
        for d in self.runs:
            self._add(d, "run")
        for d in self.serve_dirs:
            self._add(d, "serve")
        for d in self.dirs:
            kind = classify(d)
            if kind is not None:
                self._add(d, kind)
                continue
            try:
                children = sorted(c for c in d.iterdir() if c.is_dir())
            except OSError:
                continue
            for c in children:
                if (k := classify(c)) is not None:
                    self._add(c, k)

    @property
    def all(self) -> list[Source]:
        out: list[Source] = list(self._by_path.values())
        if self.fleet is not None:
            out.append(self.fleet)
        return out

    def refresh(self) -> None:
        t0 = time.perf_counter()
        self.discover()
        for s in self.all:
            s.refresh()
        self.last_collect_s = time.perf_counter() - t0

    def samples(self) -> Iterator[Sample]:
        kinds = Counter(s.kind for s in self.all)
        for k in ("run", "fleet", "serve"):
            yield Sample("gpufleet_exporter_sources", (k,), float(kinds.get(k, 0)))
        yield Sample("gpufleet_exporter_collect_seconds", (), self.last_collect_s)
        for s in self.all:
            yield from s.samples()


def classify(d: Path) -> Literal["run", "serve"] | None:
    """``run`` (a ledger), ``serve`` (a summary or capacity curve) or None (a root, or nothing)."""
    if (d / LEDGER_NAME).is_file():
        return "run"
    if (d / SUMMARY).is_file() or (d / CAPACITY).is_file():
        return "serve"
    return None

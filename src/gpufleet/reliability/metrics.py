"""MTBF, MTTR, goodput, badput and checkpoint statistics: pure functions over ledger events.

The ledger is the single source of every reliability number (docs/reliability.md has the formulas,
docs/ledger.md the event schema and the JSON form). ``summarize(events)`` returns the report object
that ``gpufleet report --json`` prints.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from gpufleet.core import events as E
from gpufleet.reliability.walk import Walk, _f, walk

__all__ = [
    "SCHEMA",
    "BADPUT_CATEGORIES",
    "PHASES",
    "percentile",
    "goodput",
    "badput",
    "mtbf",
    "mttr",
    "failures_by_cause",
    "checkpoint_stats",
    "spike_stats",
    "interval_decisions",
    "mtbf_history",
    "summarize",
]

SCHEMA = "gpufleet.report/1"
BADPUT_CATEGORIES = ("ckpt_stall", "detect", "teardown", "spawn_init", "load", "recompute", "idle")
PHASES = ("detect", "teardown", "spawn_init", "load", "first_step")
IN_PLACE_PHASES = ("supervisor", "abort", "rendezvous", "restore", "first_step")

Events = Iterable[dict[str, Any] | E.Event]  # raw ledger records or typed events


def _walk(events: Events | Walk) -> Walk:
    return events if isinstance(events, Walk) else walk(events)


def percentile(xs: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100) of ``xs``; None when empty."""
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _dist(xs: Sequence[float]) -> dict[str, float | int | None]:
    return {
        "count": len(xs),
        "mean": sum(xs) / len(xs) if xs else None,
        "p50": percentile(xs, 50),
        "p95": percentile(xs, 95),
        "max": max(xs) if xs else None,
    }


def wall_time(events: Events | Walk) -> float:
    """Σ over sessions of (last event − first ``run_start``), seconds."""
    return sum(s.wall for s in _walk(events).sessions)


def goodput(events: Events | Walk) -> float | None:
    """Productive step time ÷ wall time (rolled-back steps and stalls are not productive)."""
    w = _walk(events)
    wall = wall_time(w)
    if wall <= 0.0:
        return None
    return sum(x.work for x in w.steps if not x.wasted) / wall


def badput(events: Events | Walk) -> dict[str, float]:
    """Seconds per category; ``productive`` plus the categories of BADPUT_CATEGORIES sum to wall.

    ``idle`` is the remainder (supervisor start, gaps between steps, final shutdown, the part of an
    unrecovered failure after its teardown). It is clamped at 0 if the ledger's times overlap.
    """
    w = _walk(events)
    wall = wall_time(w)
    productive = sum(x.work for x in w.steps if not x.wasted)
    out = dict.fromkeys(BADPUT_CATEGORIES, 0.0)
    out["ckpt_stall"] = sum(x.stall for x in w.steps)
    out["recompute"] = sum(x.work for x in w.steps if x.wasted)
    out["load"] = w.load_s
    out["spawn_init"] = sum(s.spawn_init_s for s in w.sessions)
    for inc in w.incidents:
        ph = inc.phases()
        out["detect"] += ph["detect"]
        out["teardown"] += ph["teardown"]
        out["spawn_init"] += ph["spawn_init"]
    known = productive + sum(v for k, v in out.items() if k != "idle")
    out["idle"] = max(wall - known, 0.0)
    return {"productive": productive, **out}


def failures_by_cause(events: Events | Walk) -> dict[str, int]:
    """Counted failures (secondary failures of an already-failed attempt excluded) per cause."""
    return dict(Counter(str(f.cause) for f in _walk(events).failures))


def mtbf(events: Events | Walk) -> tuple[float | None, float, int]:
    """(MTBF, uptime, failures): uptime = wall − Σ downtime (failure happened → first step after
    restore, or → session end if unrecovered); MTBF = uptime ÷ failures, None without failures."""
    w = _walk(events)
    n = len(w.failures)
    uptime = max(wall_time(w) - sum(i.downtime for i in w.incidents), 0.0)
    return (uptime / n if n else None), uptime, n


def mttr(events: Events | Walk) -> dict[str, Any]:
    """Mean time to recovery over recovered incidents, with the mean of each phase.

    MTTR = failure happened → first step completed after the restore
         = detect + teardown + spawn_init + load + first_step.
    ``recompute_mean_s`` (listed separately, not part of MTTR) is the mean rolled-back work.
    """
    rec = [i for i in _walk(events).incidents if i.recovered]
    vals = [i.mttr or 0.0 for i in rec]
    phases = {p: (sum(i.phases()[p] for i in rec) / len(rec) if rec else None) for p in PHASES}
    return {
        "count": len(rec),
        "mean_s": sum(vals) / len(vals) if vals else None,
        "p50_s": percentile(vals, 50),
        "max_s": max(vals) if vals else None,
        "phases_mean_s": phases,
        "recompute_mean_s": sum(i.recompute_s for i in rec) / len(rec) if rec else None,
        "in_process": _in_place_mttr(rec),
    }


def _in_place_mttr(rec: list[Any]) -> dict[str, Any] | None:
    """The in-process recoveries alone, on their own critical path (``Incident.in_place_phases``:
    supervisor, abort, rendezvous, restore, first_step) and where each restore read its state."""
    parts = [(i, ph) for i in rec if (ph := i.in_place_phases()) is not None]
    if not parts:
        return None
    n = len(parts)
    return {
        "count": n,
        "mean_s": sum(i.mttr or 0.0 for i, _ in parts) / n,
        "phases_mean_s": {k: sum(ph[k] for _, ph in parts) / n for k in IN_PLACE_PHASES},
        "restore_sources": dict(Counter(i.restore_source or "unknown" for i, _ in parts)),
    }


def spike_stats(events: Events | Walk) -> dict[str, Any]:
    """Loss-spike alarms by kind and outcome, and the false alarms among them (docs/reliability.md).

    ``flagged`` = alarms (one per session and step); ``injected`` = those a drill caused; ``outcome``
    splits all of them: ``transient`` (the replay passed the step), ``data_driven`` (the replay
    reproduced it; ``identical``: with exactly the same value), ``unresolved`` (no replay yet).
    ``false_alarms`` = data-driven alarms on a finite loss that no drill injected."""
    alarms = _walk(events).alarms
    outcome = Counter(a.outcome for a in alarms)
    return {
        "flagged": len(alarms),
        "injected": sum(a.injected for a in alarms),
        "non_finite": sum(a.value is None for a in alarms),
        "outcome": {k: outcome.get(k, 0) for k in ("transient", "data_driven", "unresolved")},
        "identical": sum(a.identical for a in alarms),
        "false_alarms": sum(a.false_alarm for a in alarms),
        "alarms": [
            {
                "session": a.session,
                "step": a.step,
                "value": a.value,
                "injected": a.injected,
                "outcome": a.outcome,
                "replay_value": a.replay_value,
                "identical": a.identical,
                "false_alarm": a.false_alarm,
            }
            for a in alarms
        ],
    }


def checkpoint_stats(events: Events | Walk) -> dict[str, Any]:
    """Counts, stall / persist / upload time distributions and sizes of checkpoints."""
    w = _walk(events)
    committed = w.events(E.CkptCommitted)
    staged = w.events(E.CkptStaged)
    uploaded = w.events(E.CkptUploaded)
    failed = w.events(E.CkptFailed)
    sizes = [e.bytes for e in committed]
    return {
        "staged": len(staged),
        "committed": len(committed),
        "failed": len(failed),
        "skipped": len(w.events(E.CkptSkipped)),
        "uploaded": len(uploaded),
        "verified": len(w.events(E.CkptVerified)),
        "deleted": len(w.events(E.CkptDeleted)),
        "restore_rejected": len(w.events(E.RestoreRejected)),
        "stall_s": _dist([_f(e.stall_s) for e in staged]),
        "stage_s": _dist([_f(e.stage_s) for e in staged]),
        "persist_s": _dist([_f(e.persist_s) for e in committed]),
        "upload_s": _dist([_f(e.upload_s) for e in uploaded]),
        "bytes_last": sizes[-1] if sizes else None,
        "bytes_committed_total": sum(sizes),
        "last_committed_step": max((e.step for e in committed), default=None),
        "failures": [{"step": e.step, "reason": e.reason} for e in failed],
    }


_INTERVAL_KEYS = (
    "policy",
    "model",
    "every_steps",
    "every_s",
    "delta_s",
    "mtbf_s",
    "mtbf_source",
    "persist_s",
)


def stragglers(events: Events | Walk) -> list[dict[str, Any]]:
    """Ranks the supervisor flagged as slower than their peers (``straggler`` events), oldest first."""
    return [
        {
            "attempt": e.attempt,
            "rank": e.rank,
            "node": e.node,
            "step": e.step,
            "section": str(e.section),
            "seconds": e.seconds,
            "peers_s": e.peers_s,
            "ratio": e.ratio,
        }
        for e in _walk(events).events(E.Straggler)
    ]


def interval_decisions(events: Events | Walk) -> list[dict[str, Any]]:
    """Every ``interval`` event (t, step, and the decision's fields that are set)."""
    out = []
    for e in _walk(events).events(E.Interval):
        d: dict[str, Any] = {"t": e.t, "step": e.step}
        for k in _INTERVAL_KEYS:
            v = getattr(e, k)
            if v is not None:
                d[k] = str(v) if k == "policy" else v
        out.append(d)
    return out


def mtbf_history(
    run_dir_events: Events | Walk | str | os.PathLike[str], configured: float | None = None
) -> float | None:
    """MTBF from this and earlier sessions of a run directory (events, or the directory itself).

    Returns uptime ÷ failures when at least one failure was recorded, else ``configured`` (which is
    None by default: the caller then uses its own configured value).
    """
    if isinstance(run_dir_events, str | os.PathLike):
        from gpufleet.core.ledger import read_events

        run_dir_events = read_events(run_dir_events)
    m, _, n = mtbf(run_dir_events)
    return m if n and m is not None and m > 0.0 else configured


def _incident_dict(i: Any) -> dict[str, Any]:
    return {
        "cause": i.cause,
        "session": i.session,
        "attempt": i.attempt,
        "rank": i.rank,
        "step": i.step,
        "happened_t": i.t_happen,
        "detected_t": i.t_detect,
        "recovered": i.recovered,
        "restore_step": i.restore_step,
        "mttr_s": i.mttr,
        "phases_s": i.phases(),
        "path": i.path,
        "abort_s": i.abort_s,
        "in_place_phases_s": i.in_place_phases(),
        "restore_source": i.restore_source,
        "recompute_s": i.recompute_s,
        "lost_steps": i.lost_steps,
        "failures": i.failures,
        "secondary_failures": i.secondary,
    }


def summarize(events: Events, run_dir: str | None = None) -> dict[str, Any]:
    """The whole report as one JSON-serialisable object (schema ``gpufleet.report/1``)."""
    w = walk(events)
    wall = wall_time(w)
    bp = badput(w)
    m, uptime, nfail = mtbf(w)
    done = [x for x in w.steps if not x.wasted]
    ready = [_f(e.init_s) for e in w.worker_ready]
    return {
        "schema": SCHEMA,
        "run_dir": run_dir,
        "sessions": [
            {
                "session": s.id,
                "start_t": s.start,
                "end_t": s.end,
                "wall_s": s.wall,
                "status": s.status,
                "exit_code": s.exit_code,
                "attempts": s.attempts,
                "restarts": s.restarts,
            }
            for s in w.sessions
        ],
        "wall_s": wall,
        "uptime_s": uptime,
        "productive_s": bp["productive"],
        "goodput": bp["productive"] / wall if wall > 0 else None,
        "steps": {
            "executed": len(w.steps),
            "productive": len(done),
            "rolled_back": len(w.steps) - len(done),
            "last_step": max((x.step for x in done), default=None),
            "mean_step_s": (sum(x.work for x in w.steps) / len(w.steps)) if w.steps else None,
        },
        "badput": {k: {"s": v, "share": (v / wall if wall > 0 else None)} for k, v in bp.items()},
        "failures": {
            "count": nfail,
            "by_cause": failures_by_cause(w),
            "unrecovered": sum(1 for i in w.incidents if not i.recovered),
        },
        "mtbf_s": m,
        "mttr": mttr(w),
        "incidents": [_incident_dict(i) for i in w.incidents],
        "restarts": sum(s.restarts for s in w.sessions),
        "rollbacks": len(w.rollbacks),
        "skipped_windows": len(w.skipped_windows),
        "skipped_steps": sum(b - a for a, b in w.skipped_windows),
        "spikes": spike_stats(w),
        "stragglers": stragglers(w),
        "restores": len(w.restores),
        "worker_init_s": _dist(ready),
        "checkpoints": checkpoint_stats(w),
        "interval": interval_decisions(w),
    }

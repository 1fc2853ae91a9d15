"""The node state log (fleet ledger) and node reputation: state, MTBF, MTTR, lemons, exclude lists.

Node states are ``node_state`` events in the *fleet ledger*: the same append-only JSONL
:class:`~gpufleet.core.ledger.Ledger` the runs use, kept in the fleet state directory
(:func:`fleet_dir`: ``$GPUFLEET_FLEET_DIR``, else ``./.gpufleet/fleet``). Everything here is computed
from that log and from nothing else.

States and what they mean for reputation::

    healthy ──FAIL──▶ suspect ──▶ drained ──▶ repaired ──▶ validated ──▶ in_service
       ▲                 │                                                  │
       └──── passing ────┘                                                  ▼ (FAIL) suspect ...

- *good* states: ``healthy``, ``validated``, ``in_service``;
- *down* states: ``suspect``, ``drained``, ``repaired`` (fixed but not yet validated).

A **failure** is a transition from a good state (or no state yet) into ``suspect`` or ``drained``;
``suspect`` → ``drained`` continues the same failure. A **repair** ends when a down node returns
to a good state; its duration is the repair time. Per node:

- MTBF = time in good states / failures (None without failures);
- MTTR = mean of completed repair times (None without any);
- lemon = at least ``lemon_failures`` failures within the last ``lemon_window_s`` seconds
  (defaults 3 in 30 days; env ``GPUFLEET_LEMON_FAILURES`` / ``GPUFLEET_LEMON_WINDOW_DAYS``), or an
  escalated remedy (below).

A failure may carry a **remedy**, the action class of the XID/SXID behind it
(:data:`gpufleet.health.xid.ACTIONS`: watch, drain, reset_gpu, reboot, service_required). The node's
remedy is its newest failure's; when a ``reset_gpu`` or ``reboot`` remedy comes back within the lemon
window, the reset did not fix the fault and the remedy escalates to ``service_required`` (NVIDIA's
escalation: drain, reset, then service), which also makes the node a lemon.

:func:`exclude_list` returns the nodes a scheduler should keep jobs off: currently down, or lemons.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpufleet.core import events as E
from gpufleet.core.env import Env
from gpufleet.core.errors import UsageError
from gpufleet.core.ledger import Ledger, read_events

__all__ = [
    "STATES",
    "GOOD_STATES",
    "DOWN_STATES",
    "COMPONENTS",
    "NodeSummary",
    "fleet_dir",
    "record_state",
    "node_states",
    "current_state",
    "node_table",
    "exclude_list",
    "lemon_settings",
]

STATES = tuple(s.value for s in E.NodeStateName)  # healthy suspect drained repaired validated in_service
GOOD_STATES = frozenset({"healthy", "validated", "in_service"})
DOWN_STATES = frozenset({"suspect", "drained", "repaired"})
FAILURE_STATES = frozenset({"suspect", "drained"})
COMPONENTS = tuple(c.value for c in E.Component)  # gpu memory network storage host software unknown
BY = tuple(a.value for a in E.Actor)  # gpufleet admin


def fleet_dir(fleet: str | os.PathLike[str] | None = None) -> Path:
    """The fleet state directory: ``fleet``, else ``$GPUFLEET_FLEET_DIR``, else ``./.gpufleet/fleet``."""
    if fleet is not None:
        return Path(fleet)
    env = Env.FLEET_DIR.get()
    return Path(env) if env else Path(".gpufleet") / "fleet"


def record_state(
    node: str,
    state: str,
    reason: str,
    *,
    component: str = "unknown",
    check: str | None = None,
    by: str = "gpufleet",
    fleet: str | os.PathLike[str] | None = None,
    t: float | None = None,
    remedy: str | None = None,
) -> dict[str, Any]:
    """Append one ``node_state`` event to the fleet ledger and return its fields."""
    from gpufleet.health.xid import ACTIONS

    if not node:
        raise UsageError("node name must not be empty")
    if state not in STATES:
        raise UsageError(f"unknown node state {state!r}; valid: {', '.join(STATES)}")
    if component not in COMPONENTS:
        raise UsageError(f"unknown component {component!r}; valid: {', '.join(COMPONENTS)}")
    if by not in BY:
        raise UsageError(f"unknown actor {by!r}; valid: {', '.join(BY)}")
    if remedy is not None and remedy not in ACTIONS:
        raise UsageError(f"unknown remedy {remedy!r}; valid: {', '.join(ACTIONS)}")
    fields: dict[str, Any] = {"node": node, "state": state, "reason": reason}
    fields.update(component=component, by=by)
    if check is not None:
        fields["check"] = check
    if remedy is not None:
        fields["remedy"] = remedy
    if t is not None:
        fields["t"] = t
    with Ledger(fleet_dir(fleet)) as ledger:
        ledger.emit(E.NodeState(**fields))
    return fields


def node_states(fleet: str | os.PathLike[str] | None = None) -> dict[str, list[dict[str, Any]]]:
    """``node_state`` events per node, in time order."""
    out: dict[str, list[dict[str, Any]]] = {}
    for e in read_events(fleet_dir(fleet)):
        if e.get("ev") == E.NodeState.kind and e.get("node") and e.get("state") in STATES:
            out.setdefault(str(e["node"]), []).append(e)
    for evs in out.values():
        evs.sort(key=lambda e: float(e.get("t", 0.0)))
    return out


def current_state(node: str, fleet: str | os.PathLike[str] | None = None) -> dict[str, Any] | None:
    """The newest ``node_state`` event of ``node`` (None when the log never mentions it)."""
    evs = node_states(fleet).get(node)
    return evs[-1] if evs else None


def lemon_settings(
    lemon_failures: int | None = None, lemon_window_days: float | None = None
) -> tuple[int, float]:
    """(failures, window seconds): explicit values, else ``GPUFLEET_LEMON_*`` or their defaults."""
    n = lemon_failures
    if n is None:
        n = Env.LEMON_FAILURES.get()
    days = lemon_window_days
    if days is None:
        days = Env.LEMON_WINDOW_DAYS.get()
    if n < 1 or days <= 0:
        raise UsageError("lemon threshold needs failures >= 1 and a positive window")
    return n, days * 86400.0


@dataclass
class NodeSummary:
    """One row of ``gpufleet nodes``."""

    node: str
    state: str
    since: float
    reason: str
    by: str
    failures: int
    repairs: int
    mtbf_s: float | None
    mttr_s: float | None
    failures_by_component: dict[str, int] = field(default_factory=dict)
    recent_failures: int = 0
    lemon: bool = False
    failures_by_remedy: dict[str, int] = field(default_factory=dict)
    remedy: str | None = None  # the newest failure's remedy, escalated (see the module doc)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize_node(
    node: str, events: Iterable[dict[str, Any]], *, now: float, lemon_failures: int, lemon_window_s: float
) -> NodeSummary:
    """Reputation of one node from its ``node_state`` events (time-ordered)."""
    evs = list(events)
    failures: list[float] = []
    repair_times: list[float] = []
    by_component: Counter[str] = Counter()
    remedy_of: dict[float, str] = {}  # failure time -> its remedy
    good_time = 0.0
    state: str | None = None
    entered = float(evs[0].get("t", now)) if evs else now
    failed_at: float | None = None
    for e in evs:
        t, new = float(e.get("t", now)), str(e["state"])
        if state is not None and state in GOOD_STATES:
            good_time += max(0.0, t - entered)
        was_down = state in DOWN_STATES
        if new in FAILURE_STATES and not was_down:
            failures.append(t)
            failed_at = t
            by_component[str(e.get("component", "unknown"))] += 1
            if e.get("remedy"):
                remedy_of[t] = str(e["remedy"])
        elif new in FAILURE_STATES and e.get("remedy") and failed_at is not None:
            remedy_of[failed_at] = str(e["remedy"])  # the same failure (suspect -> drained), now classed
        elif new in GOOD_STATES and was_down and failed_at is not None:
            repair_times.append(t - failed_at)
            failed_at = None
        if new != state:
            state, entered = new, t
    if state in GOOD_STATES:
        good_time += max(0.0, now - entered)
    last = evs[-1]
    recent = sum(1 for t in failures if t >= now - lemon_window_s)
    remedies = sorted(remedy_of.items())
    by_remedy = Counter(r for _t, r in remedies)
    remedy, escalated = escalate(remedies, now - lemon_window_s)
    return NodeSummary(
        node=node,
        state=str(last["state"]),
        since=entered,
        reason=str(last.get("reason", "")),
        by=str(last.get("by", "gpufleet")),
        failures=len(failures),
        repairs=len(repair_times),
        mtbf_s=good_time / len(failures) if failures else None,
        mttr_s=sum(repair_times) / len(repair_times) if repair_times else None,
        failures_by_component=dict(sorted(by_component.items())),
        recent_failures=recent,
        lemon=recent >= lemon_failures or escalated,
        failures_by_remedy=dict(sorted(by_remedy.items())),
        remedy=remedy,
    )


RESETS = ("reset_gpu", "reboot")


def escalate(remedies: list[tuple[float, str]], since: float) -> tuple[str | None, bool]:
    """(the node's remedy, escalated): the newest remedy, or ``service_required`` when a reset or
    reboot remedy came back after an earlier one (both at or after ``since``)."""
    if not remedies:
        return None, False
    newest = remedies[-1][1]
    recent = [r for t, r in remedies if t >= since and r in RESETS]
    if newest in RESETS and len(recent) >= 2:
        return "service_required", True
    return newest, False


def node_table(
    fleet: str | os.PathLike[str] | None = None,
    *,
    now: float | None = None,
    lemon_failures: int | None = None,
    lemon_window_days: float | None = None,
) -> list[NodeSummary]:
    """One :class:`NodeSummary` per node in the fleet ledger, sorted by node name."""
    n, window_s = lemon_settings(lemon_failures, lemon_window_days)
    now = time.time() if now is None else now
    return [
        summarize_node(node, evs, now=now, lemon_failures=n, lemon_window_s=window_s)
        for node, evs in sorted(node_states(fleet).items())
    ]


def exclude_list(
    fleet: str | os.PathLike[str] | None = None,
    *,
    now: float | None = None,
    lemon_failures: int | None = None,
    lemon_window_days: float | None = None,
) -> list[str]:
    """Nodes to keep new jobs off (sorted): currently suspect, drained or repaired, or lemons."""
    rows = node_table(fleet, now=now, lemon_failures=lemon_failures, lemon_window_days=lemon_window_days)
    return [r.node for r in rows if r.state in DOWN_STATES or r.lemon]

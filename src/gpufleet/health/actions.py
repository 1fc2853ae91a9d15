"""Node actions: isolate a node and release it, on any platform, behind one circuit breaker.

One API (:class:`NodeActions`), one implementation per platform in its backend package:
:class:`~gpufleet.backends.slurm.actions.SlurmActions` (drain / resume),
:class:`~gpufleet.backends.k8s.actions.K8sActions` (cordon + taint / uncordon) and
:class:`~gpufleet.backends.ray.quarantine.RayActions` (hold the node's resource / end the hold).

Ownership (as NHC does with ``NHC:``): gpufleet isolates with a reason ``gpufleet: <check>: <detail>``
(:func:`make_reason`) and only ever releases a node whose isolation it owns. A node someone else (an
administrator) took out is left alone: not isolated over, never released.

Circuit breaker (:class:`Breaker`): when more than ``max_fraction`` of a platform's nodes were isolated
by gpufleet within ``window_s`` (defaults: :data:`BREAKER_FRACTION` in :data:`BREAKER_WINDOW_S`, as
NVSentinel; ``GPUFLEET_BREAKER_FRACTION`` and ``GPUFLEET_BREAKER_WINDOW_S`` override them), a mass
failure is more likely a fabric, storage or software problem than N bad nodes, so further isolations
are refused and an alert is raised instead. The breaker counts the ``node_action`` events in the fleet
ledger, so every process on every node (supervisors, health-check programs, sweeps) shares it.

Every decision, done, refused or failed, is one ``node_action`` event in the fleet ledger (and in the
caller's sink, a run's ledger); an isolation or release done is also a ``node_state``.
"""

from __future__ import annotations

import os
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Collection
from typing import ClassVar

from gpufleet.core import events as E
from gpufleet.core.env import Env
from gpufleet.core.ledger import EventSink, Ledger, read_events

__all__ = [
    "BREAKER_FRACTION",
    "BREAKER_WINDOW_S",
    "PREFIX",
    "Breaker",
    "NodeActionError",
    "NodeActions",
    "make_reason",
    "owned",
]

PREFIX = "gpufleet:"
BREAKER_FRACTION = Env.BREAKER_FRACTION.default
"""The breaker's default limit: the share of a platform's nodes gpufleet may isolate within the window."""
BREAKER_WINDOW_S = Env.BREAKER_WINDOW_S.default
"""The breaker's default window, seconds."""
REASON_MAX = 200  # characters: Slurm's reason field and a Kubernetes annotation both take this


class NodeActionError(RuntimeError):
    """A platform command or API call behind a node action failed or timed out."""


def owned(reason: str) -> bool:
    """True when ``reason`` is gpufleet's (it starts with :data:`PREFIX`)."""
    return reason.strip().startswith(PREFIX)


def make_reason(check: str, detail: str) -> str:
    """``gpufleet: <check>: <detail>`` on one line, short enough for every platform's reason field."""
    detail = " ".join(detail.split())
    return f"{PREFIX} {check}: {detail}"[:REASON_MAX]


class Breaker:
    """Refuses isolations on ``platform`` once more than ``max_fraction`` of its nodes were hit within
    ``window_s`` (from the fleet ledger's ``node_action`` events)."""

    def __init__(
        self,
        platform: E.NodePlatform,
        fleet: str | os.PathLike[str] | None = None,
        max_fraction: float | None = None,
        window_s: float | None = None,
    ) -> None:
        from gpufleet.health.nodes import fleet_dir

        self.platform = platform
        self.dir = fleet_dir(fleet)
        if max_fraction is None:
            max_fraction = Env.BREAKER_FRACTION.get()
        self.max_fraction = max_fraction
        if window_s is None:
            window_s = Env.BREAKER_WINDOW_S.get()
        self.window_s = window_s

    def recent(self, now: float | None = None) -> set[str]:
        """Nodes of this platform gpufleet isolated within the window."""
        now = time.time() if now is None else now
        return {
            str(e["node"])
            for e in read_events(self.dir)
            if e.get("ev") == E.NodeAction.kind
            and e.get("platform") == self.platform
            and e.get("action") == E.NodeActionKind.ISOLATE
            and e.get("result") == E.ActionResult.DONE
            and now - float(e.get("t", 0.0)) <= self.window_s
        }

    def allows(
        self, node: str, total: int, held: Collection[str] = (), now: float | None = None
    ) -> tuple[bool, int]:
        """(allowed, nodes hit including this one). ``held``: nodes the platform knows are isolated now,
        counted besides the window's."""
        hit = len(self.recent(now) | set(held) | {node})
        return (total > 0 and hit / total <= self.max_fraction), hit


class NodeActions(ABC):
    """Isolate and release nodes of one platform (see the module doc). Subclasses set :attr:`platform`
    and implement :meth:`isolate` and :meth:`release` with :meth:`record`, :meth:`guard` and
    :meth:`mark`."""

    platform: ClassVar[E.NodePlatform]

    def __init__(
        self,
        sink: EventSink | None = None,
        fleet: str | os.PathLike[str] | None = None,
        breaker: Breaker | None = None,
    ) -> None:
        self.sink = sink
        self.fleet = fleet
        self.breaker = breaker or Breaker(self.platform, fleet)
        self.remedy: str | None = None  # the XID/SXID class behind the next isolation (remediate.py)

    @abstractmethod
    def isolate(self, node: str, check: str, detail: str, component: str = "unknown") -> bool:
        """Take ``node`` out with an owned reason (:func:`make_reason`). True when it is isolated (now
        or already, by gpufleet); False when refused (not gpufleet's, breaker open) or failed."""

    @abstractmethod
    def release(self, node: str, why: str = "released by gpufleet", only_check: str | None = None) -> bool:
        """Undo gpufleet's own isolation of ``node`` (only ``only_check``'s, when given). False when
        there is none to undo."""

    # -- for the platforms -----------------------------------------------------------------------
    def record(
        self,
        node: str,
        action: E.NodeActionKind,
        result: E.ActionResult,
        reason: str,
        *,
        check: str | None = None,
        previous: str | None = None,
        hit: int | None = None,
        total: int | None = None,
    ) -> None:
        """One ``node_action`` event, in the fleet ledger and the sink."""
        from gpufleet.health.nodes import fleet_dir

        event = E.NodeAction(
            node=node,
            platform=self.platform,
            action=action,
            result=result,
            reason=reason,
            check=check,
            previous=previous,
            hit=hit,
            total=total,
        )
        with Ledger(fleet_dir(self.fleet)) as fl:
            fl.emit(event)
        if self.sink is not None:
            self.sink.emit(event)

    def guard(self, node: str, total: int, check: str, detail: str, held: Collection[str] = ()) -> bool:
        """Ask the breaker; on a refusal record it and print an ALERT line. True when allowed."""
        ok, hit = self.breaker.allows(node, total, held)
        if ok:
            return True
        b = self.breaker
        why = (
            f"circuit breaker open: {hit}/{total} {self.platform} nodes isolated within {b.window_s:.0f}s "
            f"(limit {b.max_fraction:.0%}); {check}: {' '.join(detail.split())}"
        )
        refused = E.ActionResult.REFUSED
        self.record(node, E.NodeActionKind.ISOLATE, refused, why, check=check, hit=hit, total=total)
        print(f"gpufleet: ALERT: {why}; not isolating {node}", file=sys.stderr)
        return False

    def mark(
        self, node: str, state: str, reason: str, *, component: str = "unknown", check: str | None = None
    ) -> None:
        """The node state that an isolation (``drained``, ``suspect``) or release leaves."""
        from gpufleet.health.nodes import COMPONENTS, record_state

        comp = component if component in COMPONENTS else "unknown"
        remedy = self.remedy if state in ("drained", "suspect") else None
        record_state(node, state, reason, component=comp, check=check, fleet=self.fleet, remedy=remedy)

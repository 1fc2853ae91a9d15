"""Acting on XID/SXID classes: a report's remedy becomes a node isolation, only with the operator's flag.

:func:`remediate` takes a report's most disruptive action class among its failing XID/SXID results
(:func:`gpufleet.health.passive.report_remedy`). When the operator allowed that class (``allow``, the
CLI's ``--act``), the node is isolated through the platform's :class:`~gpufleet.health.actions.NodeActions`
with the owned reason ``gpufleet: <check>: <remedy>: <detail>``: the same path every other drain takes,
so the circuit breaker guards it, a ``node_action`` event audits it, and the ``drained`` node state
carries the remedy (the reputation escalates repeated resets to ``service_required``). gpufleet does
not reset GPUs or reboot nodes itself: the isolation names what the node needs, and the operator's
tooling (or a person) carries it out and releases the node. ``watch`` is never acted on.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from gpufleet.core.errors import UsageError
from gpufleet.health.actions import NodeActionError, NodeActions
from gpufleet.health.passive import report_remedy
from gpufleet.health.results import Report
from gpufleet.health.xid import ACTIONS

__all__ = ["ACTABLE", "RemedyOutcome", "parse_allow", "remediate"]

ACTABLE = tuple(a for a in ACTIONS if a != "watch")


@dataclass
class RemedyOutcome:
    """What a report calls for and what came of it."""

    node: str
    action: str  # the action class
    check: str
    detail: str
    outcome: str  # "isolated" | "not allowed" | "refused" | "failed: <error>"


def parse_allow(text: str) -> frozenset[str]:
    """``--act`` text (comma-separated classes, or ``all``) as a set. Raises :class:`UsageError`."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    if names == ["all"]:
        return frozenset(ACTABLE)
    bad = [n for n in names if n not in ACTABLE]
    if bad or not names:
        raise UsageError(
            f"unknown action class {', '.join(bad) or repr(text)}; valid: {', '.join(ACTABLE)}, all"
        )
    return frozenset(names)


def remediate(report: Report, actions: NodeActions | None, allow: Collection[str]) -> RemedyOutcome | None:
    """Isolate ``report.node`` when its remedy is in ``allow`` (see the module doc). None when the
    report calls for no action (no failing XID/SXID result, or only ``watch``)."""
    action = report_remedy(report)
    if action is None or action == "watch":
        return None
    src = next(r for r in report.failures() if r.data.get("action") == action)
    detail = f"{action}: {src.detail}"
    rem = RemedyOutcome(report.node, action, src.check, detail, "not allowed")
    if action not in allow or actions is None:
        return rem
    actions.remedy = action
    try:
        ok = actions.isolate(report.node, src.check, detail, component=src.component)
    except NodeActionError as e:
        rem.outcome = f"failed: {e}"
        return rem
    finally:
        actions.remedy = None
    rem.outcome = "isolated" if ok else "refused"
    return rem

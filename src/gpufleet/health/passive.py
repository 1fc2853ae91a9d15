"""Passive mode: turn a plan's report into node-state transitions in the fleet ledger.

- a FAIL moves a node in a good state (or with no state yet) to ``suspect`` (reason
  ``gpufleet: <check>: <detail>``, component of the first failing check; the remedy, the most
  disruptive action class among the failing XID/SXID results, see :func:`report_remedy`);
- a report without FAIL and without INCOMPLETE brings a ``suspect`` node that gpufleet itself marked
  back to ``healthy``, and gives a node with no state yet ``healthy``;
- ``drained``/``repaired`` nodes and an administrator's ``suspect`` are left alone (drain/resume
  belongs to the Slurm actions, which never undo an administrator's decision).
"""

from __future__ import annotations

import os
from typing import Any

from gpufleet.health.nodes import GOOD_STATES, current_state, record_state
from gpufleet.health.results import Report, Status

__all__ = ["REASON_PREFIX", "transition_for", "apply_report", "report_remedy"]

REASON_PREFIX = "gpufleet: "


def transition_for(report: Report, cur: dict[str, Any] | None) -> dict[str, Any] | None:
    """The ``record_state`` keyword arguments this report calls for, or None."""
    state = cur.get("state") if cur else None
    fails = report.failures()
    if fails:
        if state is None or state in GOOD_STATES:
            f = fails[0]
            where = f" [{f.device}]" if f.device else ""
            tr = {
                "state": "suspect",
                "reason": f"{REASON_PREFIX}{f.check}{where}: {f.detail}"[:200],
                "check": f.check,
                "component": f.component if f.component else "unknown",
            }
            remedy = report_remedy(report)
            if remedy is not None:
                tr["remedy"] = remedy
            return tr
        return None
    if any(r.status is Status.INCOMPLETE for r in report.results):
        return None
    if state is None:
        return {"state": "healthy", "reason": f"{REASON_PREFIX}{report.plan} plan passed"}
    if state == "suspect" and cur is not None and cur.get("by", "gpufleet") == "gpufleet":
        return {"state": "healthy", "reason": f"{REASON_PREFIX}{report.plan} plan passed again"}
    return None


def report_remedy(report: Report) -> str | None:
    """The most disruptive action class among the report's failing results that carry one
    (``data["action"]``: gpu.xid, gpu.sxid); None when none does."""
    from gpufleet.health.xid import worst_action

    acts = [str(r.data["action"]) for r in report.failures() if r.data.get("action")]
    return worst_action(acts) if acts else None


def apply_report(report: Report, fleet: str | os.PathLike[str] | None = None) -> dict[str, Any] | None:
    """Record the transition the report calls for (if any) and return it."""
    tr = transition_for(report, current_state(report.node, fleet))
    if tr is not None:
        record_state(report.node, tr.pop("state"), tr.pop("reason"), fleet=fleet, **tr)
        return current_state(report.node, fleet)
    return None

"""Cordon and taint a failing Kubernetes node, and return it, the way gpufleet drains Slurm nodes.

Isolating a node (:meth:`K8sActions.isolate`) is one strategic-merge PATCH through the official
``kubernetes`` client: ``spec.unschedulable: true``, a ``gpufleet.io/unhealthy=CHECK:NoSchedule``
taint, the label ``gpufleet.io/reputation=bad`` (the workers' node affinity keeps off it) and the
annotation ``gpufleet.io/cordon-reason: "gpufleet: CHECK: DETAIL"``, which is what makes the cordon
gpufleet's. The rules are Slurm's (:mod:`gpufleet.health.slurm`):

- a node cordoned by someone else (unschedulable, without gpufleet's annotation) is left alone: not
  tainted, and never uncordoned by gpufleet;
- :meth:`K8sActions.release` undoes only gpufleet's own cordon (optionally only one check's);
- a circuit breaker refuses to isolate once more than ``GPUFLEET_BREAKER_FRACTION`` (0.5) of the
  cluster's nodes were isolated by gpufleet within ``GPUFLEET_BREAKER_WINDOW_S`` (300 s): a fleet-wide
  "failure" is more likely the check's (or the network's) than the nodes'.

Every decision is a ``k8s_action`` event in the fleet ledger (and in ``sink``, a run's ledger), and a
cordon or release is a ``node_state`` (drained / repaired). Tested against recorded HTTP exchanges
(tests/unit/k8s); no live cluster was used.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from gpufleet.core import events as E
from gpufleet.core.env import Env, read_env
from gpufleet.core.ledger import EventSink, Ledger, read_events
from gpufleet.k8s.manifests import REPUTATION_LABEL, TAINT_KEY

__all__ = ["K8sActions", "OWNER_ANNOTATION", "PREFIX", "node_ready", "owned_reason"]

OWNER_ANNOTATION = "gpufleet.io/cordon-reason"
PREFIX = "gpufleet: "


def owned_reason(node: Any) -> str | None:
    """gpufleet's reason when ``node`` (a V1Node) is cordoned by gpufleet; else None."""
    ann = (node.metadata.annotations or {}).get(OWNER_ANNOTATION, "")
    return ann if node.spec.unschedulable and ann.startswith(PREFIX) else None


def node_ready(core: Any, name: str) -> bool:
    """True when the node exists and its Ready condition is True."""
    from kubernetes.client.rest import ApiException

    try:
        node = core.read_node(name)
    except ApiException as e:
        if e.status == 404:
            return False
        raise
    return any(c.type == "Ready" and c.status == "True" for c in (node.status.conditions or []))


class K8sActions:
    """Isolate / return Kubernetes nodes gpufleet owns (see the module doc)."""

    def __init__(
        self,
        core: Any,
        sink: EventSink | None = None,
        fleet: str | os.PathLike[str] | None = None,
        max_fraction: float | None = None,
        window_s: float | None = None,
    ) -> None:
        self.core = core  # a kubernetes.client.CoreV1Api
        self.sink = sink
        self.fleet = fleet
        self.max_fraction = (
            read_env(Env.BREAKER_FRACTION, float, 0.5) if max_fraction is None else max_fraction
        )
        self.window_s = read_env(Env.BREAKER_WINDOW_S, float, 300.0) if window_s is None else window_s

    # -- ledger ----------------------------------------------------------------------------------
    def _emit(self, event: E.Event) -> None:
        from gpufleet.health.nodes import fleet_dir

        with Ledger(fleet_dir(self.fleet)) as fl:
            fl.emit(event)
        if self.sink is not None:
            self.sink.emit(event)

    def _result(
        self,
        node: str,
        action: E.K8sActionKind,
        result: E.ActionResult,
        reason: str,
        check: str | None = None,
    ) -> None:
        self._emit(E.K8sAction(node=node, action=action, result=result, reason=reason, check=check))

    def recent(self, now: float | None = None) -> set[str]:
        """Nodes gpufleet cordoned within the breaker's window (from the fleet ledger)."""
        from gpufleet.health.nodes import fleet_dir

        now = time.time() if now is None else now
        return {
            str(e["node"])
            for e in read_events(fleet_dir(self.fleet))
            if e.get("ev") == E.K8sAction.kind
            and e.get("action") == "cordon"
            and e.get("result") == "done"
            and now - float(e.get("t", 0.0)) <= self.window_s
        }

    # -- actions ---------------------------------------------------------------------------------
    def isolate(self, node: str, check: str, detail: str, component: str = "unknown") -> bool:
        """Cordon + taint + label ``node`` with an owned reason. False when refused or failed."""
        from kubernetes.client.rest import ApiException

        from gpufleet.health.nodes import COMPONENTS, record_state

        cordon = E.K8sActionKind.CORDON
        try:
            current = self.core.read_node(node)
            if current.spec.unschedulable and owned_reason(current) is None:
                why = "cordoned by someone else (no gpufleet annotation): left alone"
                self._result(node, cordon, E.ActionResult.REFUSED, why, check)
                return False
            if owned_reason(current) is not None:  # isolated already: nothing to do, not a new hit
                return True
            total = len(self.core.list_node().items)
            hit = len(self.recent() | {node})
            if not (total > 0 and hit / total <= self.max_fraction):
                why = (
                    f"circuit breaker open: {hit}/{total} nodes isolated within {self.window_s:.0f}s "
                    f"(limit {self.max_fraction:.0%}); {check}: {detail}"
                )
                self._result(node, cordon, E.ActionResult.REFUSED, why, check)
                print(f"gpufleet: ALERT: {why}; not cordoning {node}", file=sys.stderr)
                return False
            reason = f"{PREFIX}{check}: {detail}"[:250]
            body = {
                "metadata": {"annotations": {OWNER_ANNOTATION: reason}, "labels": {REPUTATION_LABEL: "bad"}},
                "spec": {
                    "unschedulable": True,
                    "taints": [{"key": TAINT_KEY, "value": check, "effect": "NoSchedule"}],
                },
            }
            self.core.patch_node(node, body)
        except ApiException as e:
            self._result(node, cordon, E.ActionResult.FAILED, f"API {e.status}: {e.reason}", check)
            return False
        self._result(node, cordon, E.ActionResult.DONE, reason, check)
        comp = component if component in COMPONENTS else "unknown"
        record_state(node, "drained", reason, component=comp, check=check, fleet=self.fleet)
        return True

    def release(self, node: str, why: str = "returned by gpufleet", only_check: str | None = None) -> bool:
        """Undo gpufleet's own cordon of ``node`` (only ``only_check``'s, when given). False if not ours."""
        from kubernetes.client.rest import ApiException

        from gpufleet.health.nodes import record_state

        uncordon = E.K8sActionKind.UNCORDON
        try:
            current = self.core.read_node(node)
            mine = owned_reason(current)
            if mine is None or (only_check is not None and not mine.startswith(f"{PREFIX}{only_check}:")):
                if current.spec.unschedulable:
                    self._result(
                        node, uncordon, E.ActionResult.REFUSED, f"not ours: {mine or 'an admin cordon'}"
                    )
                return False
            body = {
                "metadata": {"annotations": {OWNER_ANNOTATION: None}, "labels": {REPUTATION_LABEL: None}},
                "spec": {"unschedulable": None, "taints": [{"$patch": "delete", "key": TAINT_KEY}]},
            }
            self.core.patch_node(node, body)
        except ApiException as e:
            self._result(node, uncordon, E.ActionResult.FAILED, f"API {e.status}: {e.reason}")
            return False
        self._result(node, uncordon, E.ActionResult.DONE, f"{why} (was: {mine})")
        record_state(node, "repaired", why, fleet=self.fleet)
        return True

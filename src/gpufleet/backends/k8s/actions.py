"""Cordon and taint a failing Kubernetes node (isolate), and return it (release).

Isolating a node (:meth:`K8sActions.isolate`) is one strategic-merge PATCH through the official
``kubernetes`` client: ``spec.unschedulable: true``, a ``gpufleet.io/unhealthy=CHECK:NoSchedule``
taint, the label ``gpufleet.io/reputation=bad`` (the workers' node affinity keeps off it) and the
annotation ``gpufleet.io/cordon-reason: "gpufleet: CHECK: DETAIL"``, which is what makes the cordon
gpufleet's. The rules are the node actions' (:mod:`gpufleet.health.actions`):

- a node cordoned by someone else (unschedulable, without gpufleet's annotation) is left alone: not
  tainted, and never uncordoned by gpufleet;
- :meth:`K8sActions.release` undoes only gpufleet's own cordon (optionally only one check's);
- the one circuit breaker refuses to isolate past its limit of the cluster's nodes.

Every decision is a ``node_action`` event (``platform: k8s``) in the fleet ledger (and in ``sink``, a
run's ledger), and a cordon or release is a ``node_state`` (drained / repaired). Tested against
recorded HTTP exchanges (tests/unit/backends/k8s); no live cluster was used.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

from gpufleet.backends.k8s.manifests import REPUTATION_LABEL, TAINT_KEY
from gpufleet.core import events as E
from gpufleet.core.ledger import EventSink
from gpufleet.health.actions import Breaker, NodeActions, make_reason, owned

__all__ = ["K8sActions", "OWNER_ANNOTATION", "node_ready", "owned_reason"]

OWNER_ANNOTATION = "gpufleet.io/cordon-reason"


def owned_reason(node: Any) -> str | None:
    """gpufleet's reason when ``node`` (a V1Node) is cordoned by gpufleet; else None."""
    ann = (node.metadata.annotations or {}).get(OWNER_ANNOTATION, "")
    return ann if node.spec.unschedulable and owned(ann) else None


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


class K8sActions(NodeActions):
    """Isolate (cordon + taint + label) and release Kubernetes nodes gpufleet owns (see the module doc)."""

    platform: ClassVar[E.NodePlatform] = E.NodePlatform.K8S

    def __init__(
        self,
        core: Any,
        sink: EventSink | None = None,
        fleet: str | os.PathLike[str] | None = None,
        breaker: Breaker | None = None,
    ) -> None:
        super().__init__(sink, fleet, breaker)
        self.core = core  # a kubernetes.client.CoreV1Api

    def isolate(self, node: str, check: str, detail: str, component: str = "unknown") -> bool:
        """Cordon + taint + label ``node`` with an owned reason. False when refused or failed."""
        from kubernetes.client.rest import ApiException

        isolate = E.NodeActionKind.ISOLATE
        try:
            current = self.core.read_node(node)
            if current.spec.unschedulable and owned_reason(current) is None:
                why = "cordoned by someone else (no gpufleet annotation): left alone"
                self.record(node, isolate, E.ActionResult.REFUSED, why, check=check)
                return False
            if owned_reason(current) is not None:  # isolated already: nothing to do, not a new hit
                return True
            if not self.guard(node, len(self.core.list_node().items), check, detail):
                return False
            reason = make_reason(check, detail)
            body = {
                "metadata": {"annotations": {OWNER_ANNOTATION: reason}, "labels": {REPUTATION_LABEL: "bad"}},
                "spec": {
                    "unschedulable": True,
                    "taints": [{"key": TAINT_KEY, "value": check, "effect": "NoSchedule"}],
                },
            }
            self.core.patch_node(node, body)
        except ApiException as e:
            self.record(node, isolate, E.ActionResult.FAILED, f"API {e.status}: {e.reason}", check=check)
            return False
        self.record(node, isolate, E.ActionResult.DONE, reason, check=check)
        self.mark(node, "drained", reason, component=component, check=check)
        return True

    def release(self, node: str, why: str = "returned by gpufleet", only_check: str | None = None) -> bool:
        """Undo gpufleet's own cordon of ``node`` (only ``only_check``'s, when given). False if not ours."""
        from kubernetes.client.rest import ApiException

        release = E.NodeActionKind.RELEASE
        try:
            current = self.core.read_node(node)
            mine = owned_reason(current)
            if mine is None or (only_check is not None and not mine.startswith(make_reason(only_check, ""))):
                if current.spec.unschedulable:
                    why = f"not ours: {mine or 'an admin cordon'}"
                    self.record(node, release, E.ActionResult.REFUSED, why)
                return False
            body = {
                "metadata": {"annotations": {OWNER_ANNOTATION: None}, "labels": {REPUTATION_LABEL: None}},
                "spec": {"unschedulable": None, "taints": [{"$patch": "delete", "key": TAINT_KEY}]},
            }
            self.core.patch_node(node, body)
        except ApiException as e:
            self.record(node, release, E.ActionResult.FAILED, f"API {e.status}: {e.reason}")
            return False
        self.record(node, release, E.ActionResult.DONE, why, previous=mine)
        self.mark(node, "repaired", why)
        return True

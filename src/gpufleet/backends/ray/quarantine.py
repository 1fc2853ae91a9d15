"""Node health on a Ray cluster: ``gpufleet health check`` as one Ray task per node, and quarantine.

:func:`health_sweep` runs the check once on every alive node that offers the ``gpufleet`` custom
resource, as a Ray task pinned to that node (hard node affinity), and records every node's results in
the fleet ledger (``health_result``, as ``gpufleet health check`` writes them).

Acting on the results is off unless asked for (``act=True``; the CLI's ``--quarantine``). Then a node
that FAILs is **quarantined** (:class:`RayActions`, the Ray side of :mod:`gpufleet.health.actions`): a
detached actor (:class:`_Hold`, named ``gpufleet-quarantine-<node id>``) holds all of the node's
``gpufleet`` resource, so no new placement group lands there (the backend's placement also skips what
:func:`~gpufleet.backends.ray.backend.quarantined` lists), and the node is marked ``suspect``. A
quarantined node that passes again is released (``healthy``). The one circuit breaker counts the
swept nodes, the held ones among them. Every quarantine and release, done, refused or failed, is a
``node_action`` event (``platform: ray``) in the fleet ledger: the audit trail.

Ray is imported lazily (the ``ray`` extra). CLI: ``gpufleet health sweep --backend ray`` and
``gpufleet health release --backend ray`` (:mod:`gpufleet.cli.health.ray`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from gpufleet.backends.ray.backend import NAMESPACE, QUARANTINE_PREFIX, RESOURCE, _ray, node_name, quarantined
from gpufleet.core import events as E
from gpufleet.health.actions import NodeActions, make_reason

if TYPE_CHECKING:
    from gpufleet.health.results import Report

__all__ = [
    "NodeHealth",
    "RayActions",
    "health_sweep",
    "quarantine",
    "release",
    "quarantined",
    "resolve_node",
    "report_from_dict",
    "sweep_nodes",
]


# --------------------------------------------------------------------------------- quarantine
class _Hold:
    """A detached actor that holds all of one node's ``gpufleet`` resource: placement avoids the node."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        self.since = time.time()

    def info(self) -> dict[str, Any]:
        return {"reason": self.reason, "since": self.since}


def quarantine(node_id: str, reason: str, resource: str = RESOURCE) -> bool:
    """Hold ``node_id``'s whole ``resource`` with a detached actor; False if the node has none."""
    ray = _ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if node_id in quarantined():
        return True
    total = next((n["Resources"].get(resource, 0) for n in ray.nodes() if n["NodeID"] == node_id), 0)
    if not total:
        return False
    ray.remote(_Hold).options(
        name=QUARANTINE_PREFIX + node_id,
        namespace=NAMESPACE,
        lifetime="detached",
        num_cpus=0,
        resources={resource: total},
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(reason)
    return True


def release(node_id: str) -> bool:
    """End ``node_id``'s quarantine (its resource is free again); False if it had none."""
    ray = _ray()
    name = quarantined().get(node_id)
    if name is None:
        return False
    ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
    return True


def resolve_node(name: str) -> str | None:
    """The Ray node id that ``name`` (a full node id, or a prefix such as the ledger's 12-digit name)
    names, among the cluster's nodes and the quarantined ones; None if none or several match."""
    known = {n["NodeID"] for n in _ray().nodes()} | set(quarantined())
    hits = [nid for nid in known if nid.startswith(name.lower())] if name else []
    return hits[0] if len(hits) == 1 else None


# --------------------------------------------------------------------------------- health sweep
@dataclass
class NodeHealth:
    """One node's `gpufleet health check` result from :func:`health_sweep`."""

    node_id: str
    node: str
    exit_code: int  # the CLI's: 0 ok/warn, 1 fail, 3 incomplete only, 2 bad input; -1 no verdict
    report: dict[str, Any] = field(default_factory=dict)  # the --json report
    quarantined: bool = False  # held out of placement after this sweep
    action: str = ""  # what the sweep did about the node: quarantined, released, refused: ..., ""
    error: str = ""

    def as_report(self) -> Report | None:
        """The report as a :class:`~gpufleet.health.results.Report` (None without one)."""
        return report_from_dict(self.report) if self.report else None


def report_from_dict(rep: dict[str, Any]) -> Report:
    """A ``gpufleet.health/1`` JSON report (``gpufleet health check --json``) back as a Report.

    Raises KeyError/TypeError/ValueError when it does not fit (another gpufleet version's report).
    """
    from gpufleet.health.results import CheckResult, Report, Status

    results = [CheckResult(**{**r, "status": Status(r["status"])}) for r in rep["results"]]
    keys = ("node", "plan", "profile", "started", "duration_s", "valid_until", "not_applicable")
    return Report(results=results, **{k: rep[k] for k in keys})


def _check_task(plan: str, node: str, env: dict[str, str], timeout: float) -> tuple[int, str, str]:
    """Body of the per-node task: `gpufleet health check --json`, not recorded on the node itself."""
    argv = [sys.executable, "-m", "gpufleet.cli.main", "health", "check", "--plan", plan, "--json"]
    argv += ["--node", node, "--no-record"]
    p = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **env}, timeout=timeout)
    return p.returncode, p.stdout, p.stderr[-2000:]


def sweep_nodes(resource: str = RESOURCE) -> list[dict[str, Any]]:
    """The nodes a sweep checks: alive, and offering ``resource`` (quarantined ones included)."""
    return [n for n in _ray().nodes() if n.get("Alive") and n["Resources"].get(resource, 0) > 0]


def health_sweep(
    plan: str = "quick",
    *,
    env: dict[str, str] | None = None,
    resource: str = RESOURCE,
    fleet: str | os.PathLike[str] | None = None,
    act: bool = False,
    timeout: float = 900.0,
    on_result: Any = None,
) -> list[NodeHealth]:
    """Run ``plan`` once on every alive node that offers ``resource``, one Ray task pinned to each.

    ``env``: extra environment for the check; ``{node}`` in a value becomes the node's name. Results go
    to the fleet ledger. With ``act`` (off by default), a node that FAILs is quarantined and marked
    ``suspect``, and a node gpufleet quarantined that passes again is released; each decision is a
    ``node_action`` event. ``on_result(NodeHealth)`` is called as each node's result arrives (progress).
    A check that did not finish within ``timeout`` seconds (or whose node died) has no verdict
    (``exit_code`` -1) and is left alone.
    """
    ray = _ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = sweep_nodes(resource)
    task = ray.remote(num_cpus=0, max_retries=0)(_check_task)
    refs = {}
    for n in nodes:
        name = node_name(n["NodeID"])
        node_env = {k: v.replace("{node}", name) for k, v in (env or {}).items()}
        strategy = NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
        refs[n["NodeID"]] = task.options(scheduling_strategy=strategy).remote(plan, name, node_env, timeout)
    out: list[NodeHealth] = []
    deadline = time.monotonic() + timeout + 30.0
    for n in nodes:
        nid, name = n["NodeID"], node_name(n["NodeID"])
        try:
            code, stdout, stderr = ray.get(refs[nid], timeout=max(1.0, deadline - time.monotonic()))
        except Exception as e:  # the task timed out, or it or its node died: no verdict, no action
            h = NodeHealth(nid, name, -1, error=f"{type(e).__name__}: {e}"[:500])
        else:
            try:
                report = json.loads(stdout)
            except json.JSONDecodeError:
                report = {}
            h = NodeHealth(nid, name, code, report, error="" if report else stderr.strip())
        out.append(h)
        if on_result is not None:
            on_result(h)
    _agree(out)
    _record_reports([h.report for h in out if h.report], fleet)
    held = quarantined()
    for h in out:
        h.quarantined = h.node_id in held
    if act:
        _act(out, plan, resource, fleet)
    return out


def _agree(out: list[NodeHealth]) -> None:
    """Driver and firmware agreement across the swept nodes: an odd node's report gains a
    ``gpu.versions`` result (FAIL for a different driver), and its exit code follows."""
    from gpufleet.health.agreement import apply_agreement

    pairs = []
    for h in out:
        if h.report:
            try:
                pairs.append((h, report_from_dict(h.report)))
            except (KeyError, TypeError, ValueError):
                continue
    found = apply_agreement([rep for _h, rep in pairs])
    for h, rep in pairs:
        if rep.node in found:
            h.report = rep.to_dict()
            h.exit_code = rep.exit_code() if h.exit_code in (0, 1, 3) else h.exit_code


def _act(out: list[NodeHealth], plan: str, resource: str, fleet: str | os.PathLike[str] | None) -> None:
    """Quarantine the nodes that FAILed, release the held ones that passed; audit each decision."""
    acts = RayActions(fleet=fleet, resource=resource)
    check = f"health:{plan}"
    for h in out:
        if h.exit_code == 1 and not h.quarantined:
            failed = [r for r in h.report.get("results", []) if r.get("status") == "FAIL"]
            detail = "; ".join(f"{r['check']}: {r.get('detail', '')}" for r in failed)[:300]
            acts.remedy = _remedy(h)  # the XID/SXID class, carried into the node state
            h.quarantined = acts.isolate(h.node_id, check, detail)
            acts.remedy = None
            h.action = acts.outcome
        elif h.exit_code == 0 and h.quarantined:
            h.quarantined = not acts.release(h.node_id, why=f"health {plan} passed; quarantine lifted")
            h.action = acts.outcome


def _remedy(h: NodeHealth) -> str | None:
    from gpufleet.health.passive import report_remedy

    try:
        rep = h.as_report()
    except (KeyError, TypeError, ValueError):
        return None
    return report_remedy(rep) if rep is not None else None


class RayActions(NodeActions):
    """Quarantine (isolate) and release Ray nodes by node id; the ledger names them by
    :func:`~gpufleet.backends.ray.backend.node_name`. :attr:`outcome` says what the last call did."""

    platform: ClassVar[E.NodePlatform] = E.NodePlatform.RAY

    def __init__(self, fleet: str | os.PathLike[str] | None = None, resource: str = RESOURCE) -> None:
        super().__init__(fleet=fleet)
        self.resource = resource
        self.outcome = ""

    def isolate(self, node: str, check: str, detail: str, component: str = "unknown") -> bool:
        """Hold node id ``node``'s whole resource. False when refused (breaker open, nothing to hold)
        or failed (Ray refused the actor)."""
        name, isolate = node_name(node), E.NodeActionKind.ISOLATE
        held = quarantined()
        if node in held:
            self.outcome = "quarantined"
            return True
        total = len(sweep_nodes(self.resource))
        if not self.guard(name, total, check, detail, held={node_name(i) for i in held}):
            self.outcome = "refused: circuit breaker open"
            return False
        reason = make_reason(check, detail)
        try:
            done = quarantine(node, reason, self.resource)
        except Exception as e:  # noqa: BLE001 - Ray refused the actor: audited, the caller goes on
            self.record(name, isolate, E.ActionResult.FAILED, str(e)[:300], check=check)
            self.outcome = "failed"
            return False
        if not done:
            why = f"the node offers no {self.resource!r} resource to hold"
            self.record(name, isolate, E.ActionResult.REFUSED, why, check=check)
            self.outcome = f"refused: no {self.resource} resource"
            return False
        self.record(name, isolate, E.ActionResult.DONE, reason, check=check)
        self.mark(name, "suspect", reason, component=component, check="ray-health")
        self.outcome = "quarantined"
        return True

    def release(self, node: str, why: str = "released by gpufleet", only_check: str | None = None) -> bool:
        """End node id ``node``'s quarantine (any check's: a hold carries no check). False if none."""
        del only_check
        name, release_ = node_name(node), E.NodeActionKind.RELEASE
        if not release(node):
            self.record(name, release_, E.ActionResult.REFUSED, "not quarantined")
            self.outcome = "refused: not quarantined"
            return False
        self.record(name, release_, E.ActionResult.DONE, why)
        self.mark(name, "healthy", why)
        self.outcome = "released"
        return True


def _record_reports(reports: list[dict[str, Any]], fleet: str | os.PathLike[str] | None) -> None:
    from gpufleet.health.runner import record_report

    for rep in reports:
        try:
            record_report(report_from_dict(rep), fleet)
        except (KeyError, TypeError, ValueError) as e:  # another gpufleet version's report: keep going
            print(f"gpufleet: could not record a health report: {e}", file=sys.stderr)

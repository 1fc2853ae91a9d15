"""``gpufleet health sweep|release --backend ray``: node health on a Ray cluster (docs/backends/ray.md).

Thin: parse, call :mod:`gpufleet.backends.ray.quarantine`, render. ``sweep`` runs ``gpufleet health check``
once per alive Ray node as a Ray task pinned to it, prints each node's table and records the results in
the fleet ledger. It changes nothing on the cluster unless ``--quarantine`` is given: then a failing
node's ``gpufleet`` resource is held (new placement groups avoid it) and a held node that passes is
released, each decision audited as a ``node_action`` event. ``release`` ends one node's quarantine by
hand. Exit codes of ``sweep`` are ``health check``'s: 0 every node OK/WARN, 1 a FAIL somewhere, 3 a node
without a verdict (only INCOMPLETE problems, or the task died), 2 bad input.
"""

from __future__ import annotations

import enum
import getpass
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from gpufleet.cli.health.check import FleetOpt, PlanOpt, render_report
from gpufleet.core.errors import UsageError
from gpufleet.core.exitcodes import ExitCode

if TYPE_CHECKING:
    from gpufleet.backends.ray.quarantine import NodeHealth

__all__ = ["register", "SweepBackend", "SweepRequest", "sweep_command", "release_command"]


class SweepBackend(enum.StrEnum):
    """Where ``gpufleet health sweep`` runs the checks (Slurm nodes run them from slurmd instead)."""

    RAY = "ray"


@dataclass(kw_only=True, slots=True)
class SweepRequest:
    """A validated ``gpufleet health sweep`` (built by :meth:`parse`; bad input raises UsageError)."""

    plan: str
    """A tier name, or a plan TOML file's absolute path (the file must exist on every node too)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment for each node's check; ``{node}`` in a value becomes the node's name."""
    quarantine: bool = False
    """Act: hold failing nodes out of placement, release held nodes that pass."""
    resource: str = "gpufleet"
    """The custom resource that marks gpufleet's nodes (and that a quarantine holds)."""
    timeout_s: float = 900.0
    """Per-node limit on the check; a node past it has no verdict and is left alone."""

    @classmethod
    def parse(
        cls, plan: str, env: list[str], quarantine: bool, resource: str, timeout_s: float
    ) -> SweepRequest:
        from gpufleet.health.plans import TIERS, load_plan

        load_plan(plan)  # unknown tier or malformed file: one line, exit 2
        if plan not in TIERS:
            plan = str(Path(plan).resolve())
        pairs = {}
        for item in env:
            key, sep, value = item.partition("=")
            if not sep or not key or not key.replace("_", "a").isalnum():
                raise UsageError(f"--env {item!r} is not KEY=VALUE")
            pairs[key] = value
        if not resource:
            raise UsageError("--resource must name a Ray custom resource")
        return cls(plan=plan, env=pairs, quarantine=quarantine, resource=resource, timeout_s=timeout_s)


BackendOpt = Annotated[
    SweepBackend, typer.Option("--backend", help="The kind of cluster (ray).", case_sensitive=False)
]
AddressOpt = Annotated[
    str | None,
    typer.Option("--address", help="The Ray cluster, HOST:PORT (default: $RAY_ADDRESS, then auto)."),
]
ResourceOpt = Annotated[
    str, typer.Option("--resource", help="Custom resource of gpufleet's Ray nodes (a quarantine holds it).")
]


def _connect(address: str | None, resource: str) -> bool:
    """Join the cluster (one line + exit 2 when it does not answer); True when this call joined."""
    from gpufleet.backends.ray.backend import connect
    from gpufleet.backends.ray.quarantine import sweep_nodes

    owned = connect(address)
    if not sweep_nodes(resource):
        if owned:
            import ray

            ray.shutdown()
        raise UsageError(
            f"the Ray cluster at {address or 'auto'} has no alive node offering the {resource!r} resource "
            f"(start workers with --resources '{{\"{resource}\": N}}')"
        )
    return owned


def _summary(results: list[NodeHealth]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="Ray health sweep", title_justify="left")
    for col in ("node", "status", "exit", "quarantined", "action"):
        t.add_column(col, overflow="fold")
    for h in results:
        rep = h.as_report()
        status = str(rep.status) if rep else "no verdict"
        t.add_row(h.node, status, str(h.exit_code), "yes" if h.quarantined else "no", h.action or "-")
    Console(width=None if sys.stdout.isatty() else 160).print(t)


def _exit_code(results: list[NodeHealth]) -> int:
    codes = {h.exit_code for h in results}
    if ExitCode.CHECK_PROBLEM in codes:
        return ExitCode.CHECK_PROBLEM
    if codes - {ExitCode.OK}:
        return ExitCode.CHECK_UNKNOWN
    return ExitCode.OK


def sweep_command(
    backend: BackendOpt = SweepBackend.RAY,
    address: AddressOpt = None,
    plan: PlanOpt = "quick",
    fleet_dir: FleetOpt = None,
    quarantine: Annotated[
        bool,
        typer.Option(
            "--quarantine",
            help="Act (off by default): hold a failing node's resource so new placement groups avoid it, "
            "release a held node that passes; every decision is a node_action event in the fleet ledger.",
        ),
    ] = False,
    env: Annotated[
        list[str] | None,
        typer.Option("--env", help="KEY=VALUE for each node's check ({node} becomes the node's name)."),
    ] = None,
    resource: ResourceOpt = "gpufleet",
    timeout: Annotated[float, typer.Option("--timeout", min=1.0, help="Per-node limit, seconds.")] = 900.0,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON list of node results.")] = False,
) -> int:
    """Run `gpufleet health check` once on every alive node of a Ray cluster, as a Ray task per node."""
    from gpufleet.backends.ray.quarantine import health_sweep

    del backend  # one choice today: ray
    req = SweepRequest.parse(plan, env or [], quarantine, resource, timeout)
    owned = _connect(address, req.resource)
    try:
        results = _sweep(req, fleet_dir, health_sweep, progress=sys.stderr.isatty() and not json_out)
    finally:
        if owned:
            import ray

            ray.shutdown()
    if json_out:
        typer.echo(json.dumps([_as_json(h) for h in results], indent=2, default=str))
    else:
        for h in results:
            rep = h.as_report()
            if rep is not None:
                render_report(rep)
            else:
                typer.echo(f"{h.node}: no verdict (exit {h.exit_code}): {h.error.splitlines()[-1:] or ''}")
        _summary(results)
    return _exit_code(results)


def _sweep(req: SweepRequest, fleet: Path | None, health_sweep: Any, progress: bool) -> list[NodeHealth]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from gpufleet.backends.ray.quarantine import sweep_nodes

    with Progress(
        TextColumn("health sweep"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=Console(stderr=True), transient=True, disable=not progress,
    ) as bar:  # fmt: skip
        task = bar.add_task("nodes", total=len(sweep_nodes(req.resource)))
        return list(
            health_sweep(
                req.plan,
                env=req.env,
                resource=req.resource,
                fleet=fleet,
                act=req.quarantine,
                timeout=req.timeout_s,
                on_result=lambda _h: bar.advance(task),
            )
        )


def _as_json(h: NodeHealth) -> dict[str, Any]:
    rep = h.as_report()
    return {
        "node": h.node,
        "node_id": h.node_id,
        "exit_code": h.exit_code,
        "status": str(rep.status) if rep else None,
        "quarantined": h.quarantined,
        "action": h.action,
        "error": h.error,
        "report": h.report,
    }


def release_command(
    node: Annotated[str, typer.Argument(help="The node: its ledger name (12 hex digits) or Ray node id.")],
    backend: BackendOpt = SweepBackend.RAY,
    address: AddressOpt = None,
    fleet_dir: FleetOpt = None,
    resource: ResourceOpt = "gpufleet",
) -> int:
    """End a Ray node's quarantine by hand (audited). Exit 0 released, 1 it was not held, 2 bad input."""
    from gpufleet.backends.ray import quarantine as H
    from gpufleet.backends.ray.backend import node_name
    from gpufleet.core import events as E
    from gpufleet.health.nodes import record_state

    del backend
    if not node.strip():
        raise UsageError("the node name must not be empty")
    owned = _connect(address, resource)
    try:
        node_id = H.resolve_node(node)
        if node_id is None:
            raise UsageError(f"no single Ray node (or quarantined node) matches {node!r}")
        name = node_name(node_id)
        who = f"released by {getpass.getuser()} (gpufleet health release)"
        acts, release = H.RayActions(fleet=fleet_dir, resource=resource), E.NodeActionKind.RELEASE
        if not H.release(node_id):
            acts.record(name, release, E.ActionResult.REFUSED, "not quarantined", check="operator")
            print(f"gpufleet: Ray node {name} is not quarantined: nothing to release", file=sys.stderr)
            return ExitCode.FAILED
        acts.record(name, release, E.ActionResult.DONE, who, check="operator")
        record_state(name, "in_service", who, by="admin", fleet=fleet_dir)
        typer.echo(f"released Ray node {name}: its {resource!r} resource is free for placement again")
        return ExitCode.OK
    finally:
        if owned:
            import ray

            ray.shutdown()


def register(app: typer.Typer) -> None:
    """Add ``sweep`` and ``release`` to the ``gpufleet health`` group."""
    app.command("sweep")(sweep_command)
    app.command("release")(release_command)

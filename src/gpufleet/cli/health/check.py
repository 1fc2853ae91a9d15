"""``gpufleet health check|watch``: tiered node checks (docs/health.md).

``register(app)`` adds both commands to the ``health`` group; the options and :func:`render_report` are
shared with the group's other modules. Thin: parse, call :mod:`gpufleet.health`, render. Exit codes
of ``check`` fit Slurm's HealthCheckProgram and node-problem-detector plugins: 0 OK, 1 problem (a
FAIL), 3 unknown (INCOMPLETE).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from gpufleet.health.profiles import Profile
    from gpufleet.health.results import Report

__all__ = ["register", "render_report", "resolve_profile", "PlanOpt", "FleetOpt"]


def register(app: typer.Typer) -> None:
    """Add ``check`` and ``watch`` to the ``gpufleet health`` group."""
    app.command("check")(check)
    app.command("watch")(watch)


PlanOpt = Annotated[str, typer.Option("--plan", help="quick | postfail | acceptance, or a plan TOML file.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the gpufleet.health/1 JSON report.")]
NodeOpt = Annotated[
    str | None, typer.Option("--node", help="Node name (default: $GPUFLEET_NODE or hostname).")
]
ProfileOpt = Annotated[
    str | None,
    typer.Option("--profile", help="H100 | H200 | GB200 | B200 | A100 | CPU (default: from NVML)."),
]
ExpectOpt = Annotated[
    int | None,
    typer.Option("--expect-gpus", min=0, max=1024, help="Expected GPU count (default: the profile's)."),
]
FleetOpt = Annotated[
    Path | None,
    typer.Option("--fleet-dir", help="Fleet state dir (default: $GPUFLEET_FLEET_DIR or ./.gpufleet/fleet)."),
]


def resolve_profile(name: str | None) -> Profile:
    from gpufleet.health.nvml import NvmlUnavailable, read_gpus
    from gpufleet.health.profiles import detect_profile, get_profile

    if name:
        return get_profile(name)
    try:
        names = [g.name for g in read_gpus()]
    except NvmlUnavailable:
        names = []
    return detect_profile(names)


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def render_report(report: Report) -> None:
    from rich.console import Console
    from rich.table import Table

    colour = {"OK": "green", "WARN": "yellow", "FAIL": "red", "INCOMPLETE": "magenta"}
    t = Table(title=f"{report.node}: plan {report.plan}, profile {report.profile}", title_justify="left")
    for col in ("check", "device", "status", "measured", "threshold", "s", "detail / hint"):
        t.add_column(col, overflow="fold")
    for r in report.results:
        st = str(r.status)
        note = r.detail + (f"\n→ {r.hint}" if r.hint else "")
        t.add_row(
            r.check,
            r.device or "",
            f"[{colour[st]}]{st}[/]",
            f"{_fmt(r.value)} {r.unit}".strip(),
            f"{_fmt(r.threshold)}" if r.threshold is not None else "-",
            f"{r.duration_s:.1f}",
            note,
        )
    c = Console(width=None if sys.stdout.isatty() else 160)
    c.print(t)
    na = f"; not applicable: {', '.join(report.not_applicable)}" if report.not_applicable else ""
    c.print(f"[bold]{report.status}[/] in {report.duration_s:.1f} s (exit {report.exit_code()}){na}")


def _run(
    plan_name: str,
    node: str | None,
    profile_name: str | None,
    expect: int | None,
    fleet: Path | None,
    record: bool,
    fleet_peers: bool,
) -> Report:
    from gpufleet.core.errors import UsageError
    from gpufleet.core.paths import output_dir
    from gpufleet.health.nodes import fleet_dir
    from gpufleet.health.plans import load_plan
    from gpufleet.health.runner import (
        apply_fleet_rule,
        load_fleet_events,
        record_report,
        run_plan,
    )
    from gpufleet.health.runner import fleet_peers as peers_of

    if node is not None and not node.strip():
        raise UsageError("--node must not be empty")
    plan = load_plan(plan_name)
    profile = resolve_profile(profile_name)
    if record:
        output_dir(fleet_dir(fleet), "--fleet-dir")
    report = run_plan(plan, profile, node=node, expect_gpus=expect)
    if fleet_peers:
        apply_fleet_rule(
            report, profile, peers_of(load_fleet_events(fleet), report.node, profile.name, time.time())
        )
    if record:
        record_report(report, fleet)
    return report


def check(
    plan: PlanOpt = "quick",
    json_out: JsonOpt = False,
    node: NodeOpt = None,
    profile: ProfileOpt = None,
    expect_gpus: ExpectOpt = None,
    fleet_dir: FleetOpt = None,
    no_record: Annotated[
        bool, typer.Option("--no-record", help="Do not write results to the fleet ledger.")
    ] = False,
    no_fleet_peers: Annotated[
        bool, typer.Option("--no-fleet-peers", help="Skip the fleet-wide relative (MAD) comparison.")
    ] = False,
) -> None:
    """Run a plan on this node. Exit 0 OK/WARN, 1 a FAIL, 3 only INCOMPLETE problems, 2 bad input."""
    report = _run(plan, node, profile, expect_gpus, fleet_dir, not no_record, not no_fleet_peers)
    if json_out:
        typer.echo(json.dumps(report.to_dict(), indent=2, default=str))
    else:
        render_report(report)
    from gpufleet.health.runner import exit_past_hung_checks

    exit_past_hung_checks(report.exit_code())
    raise typer.Exit(report.exit_code())


def watch(
    plan: PlanOpt = "quick",
    interval: Annotated[float, typer.Option("--interval", min=0.0, help="Seconds between rounds.")] = 300.0,
    count: Annotated[int, typer.Option("--count", min=0, help="Rounds to run (0 = forever).")] = 0,
    json_out: Annotated[bool, typer.Option("--json", help="One JSON line per round.")] = False,
    node: NodeOpt = None,
    profile: ProfileOpt = None,
    expect_gpus: ExpectOpt = None,
    fleet_dir: FleetOpt = None,
    act: Annotated[
        str | None,
        typer.Option(
            "--act",
            help="Act on these XID/SXID classes (comma-separated: drain, reset_gpu, reboot, "
            "service_required, or all): isolate the node through --platform, audited. Off by default.",
        ),
    ] = None,
    platform: Annotated[
        str, typer.Option("--platform", help="Where --act isolates nodes: slurm (drain).")
    ] = "slurm",
) -> None:
    """Passive mode: run a plan every --interval seconds, record results and node-state transitions."""
    from gpufleet.health.passive import apply_report

    actions, allow = _actions(act, platform, fleet_dir)

    rounds = 0
    while count == 0 or rounds < count:
        t0 = time.monotonic()
        report = _run(plan, node, profile, expect_gpus, fleet_dir, True, True)
        tr = apply_report(report, fleet_dir)
        remedy = _remediate(report, actions, allow)
        line = {
            "t": report.started,
            "node": report.node,
            "plan": report.plan,
            "status": str(report.status),
            "counts": report.to_dict()["counts"],
            "transition": tr and {k: tr[k] for k in ("state", "reason")},
            "remedy": remedy and {"action": remedy.action, "outcome": remedy.outcome},
        }
        if json_out:
            typer.echo(json.dumps(line, default=str))
        else:
            moved = f" -> {tr['state']} ({tr['reason']})" if tr else ""
            moved += f"; remedy {remedy.action}: {remedy.outcome}" if remedy else ""
            typer.echo(f"{time.strftime('%H:%M:%S')} {report.node} {report.plan}: {report.status}{moved}")
        rounds += 1
        if count and rounds >= count:
            break
        time.sleep(max(0.0, interval - (time.monotonic() - t0)))


def _actions(act: str | None, platform: str, fleet: Path | None) -> tuple[Any, frozenset[str]]:
    """The platform's node actions and the allowed classes for ``--act`` (none without it)."""
    if act is None:
        return None, frozenset()
    from gpufleet.core.errors import UsageError
    from gpufleet.health.remediate import parse_allow

    allow = parse_allow(act)
    if platform != "slurm":
        raise UsageError(f"unknown --platform {platform!r}; valid: slurm")
    from gpufleet.backends.slurm.actions import SlurmActions

    return SlurmActions(fleet=fleet), allow


def _remediate(report: Report, actions: Any, allow: frozenset[str]) -> Any:
    from gpufleet.health.remediate import remediate

    return remediate(report, actions, allow)

"""``gpufleet metrics``, ``gpufleet dashboard`` and ``gpufleet mcp``: observability (docs/observability.md).

Thin: flags -> a typed request -> :mod:`gpufleet.observe` -> output. Prometheus, Grafana and MCP
libraries load inside the commands (``pip install 'gpufleet[observe]'``).
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from gpufleet.core.errors import UsageError

if TYPE_CHECKING:
    from gpufleet.health.actions import NodeActions
    from gpufleet.observe.sources import Sources

__all__ = ["register", "metrics_app", "dashboard_app", "SourceRequest"]

metrics_app = typer.Typer(
    name="metrics",
    help="Prometheus metrics from run directories, the fleet ledger and serve-bench directories.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
dashboard_app = typer.Typer(
    name="dashboard",
    help="The Grafana dashboard and the Prometheus alert rules, as files.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

DirsArg = Annotated[
    list[Path] | None,
    typer.Argument(
        help="Run directories (holding ledger.jsonl), serve-bench directories (summary.json / "
        "capacity.json), or directories of those (searched again at every scrape).",
        show_default=False,
    ),
]
FleetOpt = Annotated[
    Path | None,
    typer.Option(
        "--fleet-dir",
        help="Fleet state dir: node states and health results (default: $GPUFLEET_FLEET_DIR or "
        "./.gpufleet/fleet, when it holds a ledger).",
    ),
]
NoFleetOpt = Annotated[bool, typer.Option("--no-fleet", help="Do not export the fleet ledger.")]
ServeDirOpt = Annotated[
    list[Path] | None,
    typer.Option("--serve-dir", help="A serve-bench output directory (its newest summary), repeatable."),
]


@dataclass(frozen=True, slots=True)
class SourceRequest:
    """What to export; building one checks that every directory exists."""

    dirs: tuple[Path, ...]
    fleet_dir: Path | None
    serve_dirs: tuple[Path, ...]

    @classmethod
    def from_flags(
        cls, dirs: list[Path] | None, fleet_dir: Path | None, no_fleet: bool, serve_dirs: list[Path] | None
    ) -> SourceRequest:
        from gpufleet.core.ledger import LEDGER_NAME
        from gpufleet.health.nodes import fleet_dir as default_fleet

        for d in [*(dirs or ()), *(serve_dirs or ())]:
            if not d.is_dir():
                raise UsageError(f"not a directory: {d}")
        if fleet_dir is not None and not fleet_dir.is_dir():
            raise UsageError(f"--fleet-dir {fleet_dir}: not a directory")
        if no_fleet:
            fleet = None
        elif fleet_dir is not None:
            fleet = fleet_dir
        else:
            d = default_fleet()
            fleet = d if (d / LEDGER_NAME).is_file() else None
        if not dirs and not serve_dirs and fleet is None:
            raise UsageError("nothing to export: give run or serve-bench directories, or --fleet-dir")
        return cls(tuple(dirs or ()), fleet, tuple(serve_dirs or ()))

    def sources(self) -> Sources:
        from gpufleet.observe.sources import Sources

        return Sources(self.dirs, fleet_dir=self.fleet_dir, serve_dirs=self.serve_dirs)


@metrics_app.command("serve")
def metrics_serve(
    dirs: DirsArg = None,
    listen: Annotated[
        str, typer.Option("--listen", "-l", metavar="[ADDR:]PORT", help="Where to serve /metrics (loopback).")
    ] = "127.0.0.1:9400",
    fleet_dir: FleetOpt = None,
    no_fleet: NoFleetOpt = False,
    serve_dir: ServeDirOpt = None,
) -> None:
    """Serve /metrics for run directories, the fleet ledger and serve-bench directories until stopped.

    Ledgers are read incrementally at each scrape. Example:

      gpufleet metrics serve runs/ --fleet-dir /shared/fleet --serve-dir bench/ -l 127.0.0.1:9400
    """
    from gpufleet.observe.exporter import parse_listen, serve

    where = parse_listen(listen, "--listen")
    req = SourceRequest.from_flags(dirs, fleet_dir, no_fleet, serve_dir)
    sources = req.sources()
    t0 = time.perf_counter()
    sources.refresh()  # parse every ledger once now, so that the first scrape is as quick as the rest
    n = len(sources.all)
    print(f"gpufleet: read {n} source(s) in {time.perf_counter() - t0:.2f} s", file=sys.stderr, flush=True)
    stop = threading.Event()
    old = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with serve(sources, where) as exp:
            _announce(exp.url, exp.listen.loopback)
            stop.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _announce(url: str, loopback: bool) -> None:
    print(f"gpufleet: serving on {url}", file=sys.stderr, flush=True)
    if not loopback:
        print("gpufleet: warning: not a loopback address; /metrics has no authentication", file=sys.stderr)


@metrics_app.command("show")
def metrics_show(
    dirs: DirsArg = None,
    fleet_dir: FleetOpt = None,
    no_fleet: NoFleetOpt = False,
    serve_dir: ServeDirOpt = None,
) -> None:
    """Print one scrape (the Prometheus text format) to stdout."""
    from gpufleet.observe.exporter import exposition

    req = SourceRequest.from_flags(dirs, fleet_dir, no_fleet, serve_dir)
    sys.stdout.write(exposition(req.sources()).decode())


@metrics_app.command("textfile")
def metrics_textfile(
    dirs: DirsArg = None,
    output: Annotated[
        Path,
        typer.Option("--output", "-o", help="The .prom file (node-exporter --collector.textfile.directory)."),
    ] = Path("gpufleet.prom"),
    fleet_dir: FleetOpt = None,
    no_fleet: NoFleetOpt = False,
    serve_dir: ServeDirOpt = None,
) -> None:
    """Write one scrape for node-exporter's textfile collector (atomic rename), e.g. from a Slurm prolog."""
    from gpufleet.observe.exporter import write_textfile

    if output.suffix != ".prom":
        raise UsageError(f"--output {output}: node-exporter reads only *.prom files")
    _check_output(output)
    req = SourceRequest.from_flags(dirs, fleet_dir, no_fleet, serve_dir)
    print(f"gpufleet: wrote {write_textfile(req.sources(), output)}", file=sys.stderr)


@metrics_app.command("push")
def metrics_push(
    dirs: DirsArg = None,
    gateway: Annotated[
        str, typer.Option("--gateway", help="Pushgateway address, e.g. http://127.0.0.1:9091.")
    ] = "",
    job: Annotated[str, typer.Option("--job", help="The job label of the pushed group.")] = "gpufleet",
    instance: Annotated[
        str | None, typer.Option("--instance", help="The instance label (default: this node's name).")
    ] = None,
    fleet_dir: FleetOpt = None,
    no_fleet: NoFleetOpt = False,
    serve_dir: ServeDirOpt = None,
) -> None:
    """Push one scrape to a Prometheus Pushgateway, for short jobs."""
    from gpufleet.observe.exporter import push

    if not gateway:
        raise UsageError("--gateway is required, e.g. --gateway http://127.0.0.1:9091")
    scheme = gateway.partition("://")[0] if "://" in gateway else "http"
    if scheme not in ("http", "https") or not gateway.isprintable() or any(c.isspace() for c in gateway):
        raise UsageError(f"--gateway {gateway!r}: expected HOST:PORT or an http(s):// URL")
    if not job.replace("_", "").replace("-", "").isalnum():
        raise UsageError(f"--job {job!r}: letters, digits, '-' and '_' only")
    if instance is None:
        from gpufleet.core.launch import node_name

        instance = node_name()
    req = SourceRequest.from_flags(dirs, fleet_dir, no_fleet, serve_dir)
    push(req.sources(), gateway, job, {"instance": instance})


OutOpt = Annotated[Path | None, typer.Option("--output", "-o", help="Write here instead of stdout.")]


def _check_output(output: Path | None) -> None:
    if output is not None:
        from gpufleet.core.paths import output_file

        output_file(output, "--output")


def _write(text: str, output: Path | None) -> None:
    if output is None:
        sys.stdout.write(text)
        return
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text)
    print(f"gpufleet: wrote {output}", file=sys.stderr)


@dashboard_app.command("export")
def dashboard_export(
    output: OutOpt = None,
    title: Annotated[str, typer.Option(help="Dashboard title.")] = "gpufleet",
    uid: Annotated[str, typer.Option(help="Dashboard uid (stable across exports, for provisioning).")] = (
        "gpufleet-overview"
    ),
) -> None:
    """The Grafana dashboard JSON: fleet overview, training run, serving (import or provision it)."""
    from gpufleet.observe.dashboard import export_json

    if not uid or len(uid) > 40:
        raise UsageError("--uid must be 1 to 40 characters")
    _check_output(output)
    _write(export_json(title, uid), output)


@dashboard_app.command("rules")
def dashboard_rules(output: OutOpt = None) -> None:
    """Prometheus alert rules: stalled run, breaker tripped, drained-node surge, checkpoint failures."""
    from gpufleet.observe.rules import rules_yaml

    _check_output(output)
    _write(rules_yaml(), output)


def mcp_command(
    dirs: DirsArg = None,
    fleet_dir: FleetOpt = None,
    no_fleet: NoFleetOpt = False,
    serve_dir: ServeDirOpt = None,
    transport: Annotated[
        str, typer.Option(help="stdio (for a local assistant) or http (streamable HTTP).")
    ] = ("stdio"),
    listen: Annotated[
        str, typer.Option("--listen", "-l", metavar="[ADDR:]PORT", help="http: where to listen (loopback).")
    ] = "127.0.0.1:8765",
    allow_actions: Annotated[
        bool,
        typer.Option(
            "--allow-actions",
            help="Add the mutating tools drain_node, stop_run, start_health_check (audited, fleet ledger).",
        ),
    ] = False,
    slurm: Annotated[
        bool, typer.Option("--slurm", help="drain_node drains in Slurm too (owned reason, breaker).")
    ] = False,
) -> None:
    """An MCP server for AI assistants: runs, failures, nodes, health, capacity plans, benchmarks.

    Read-only unless --allow-actions. Examples:

      gpufleet mcp runs/ --fleet-dir /shared/fleet --serve-dir bench/

      gpufleet mcp runs/ --transport http --listen 127.0.0.1:8765   (streamable HTTP at /mcp)
    """
    from gpufleet.observe.exporter import check_bindable, parse_listen
    from gpufleet.observe.mcp_server import McpConfig, build_server

    if transport not in ("stdio", "http"):
        raise UsageError(f"--transport must be stdio or http, not {transport!r}")
    where = parse_listen(listen, "--listen")
    req = SourceRequest.from_flags(dirs, fleet_dir, no_fleet, serve_dir)
    if transport == "http":
        if not where.loopback:  # the MCP endpoint has no authentication
            raise UsageError(
                f"--listen {listen}: not a loopback address; the MCP server has no authentication, so it "
                "listens on loopback only (reach it through an authenticating proxy)"
            )
        check_bindable(where, "--listen")
    if allow_actions and req.fleet_dir is None:
        raise UsageError("--allow-actions needs a fleet directory (--fleet-dir): actions are audited there")
    cfg = McpConfig(
        dirs=list(req.dirs),
        fleet_dir=req.fleet_dir,
        serve_dirs=list(req.serve_dirs),
        allow_actions=allow_actions,
        node_actions=_slurm_actions if slurm else None,
    )
    server = build_server(cfg)
    if transport == "stdio":
        server.run("stdio")
        return
    _announce(f"http://{where.host}:{where.port}/mcp", where.loopback)
    server.run("streamable-http", host=where.host, port=where.port)


def _slurm_actions(fleet: Path) -> NodeActions:
    from gpufleet.backends.slurm.actions import SlurmActions

    return SlurmActions(fleet=fleet)


def register(app: typer.Typer) -> None:
    """Add ``metrics``, ``dashboard`` and ``mcp`` to the main CLI."""
    app.add_typer(metrics_app, name="metrics")
    app.add_typer(dashboard_app, name="dashboard")
    app.command("mcp")(mcp_command)

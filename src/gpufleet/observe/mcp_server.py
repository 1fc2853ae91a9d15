"""``gpufleet mcp``: an MCP server (the official ``mcp`` SDK) over run directories, the fleet ledger
and serve-bench directories, for an AI assistant doing chat-ops.

Read-only by default. Tools: list runs, a run's report, why a run failed and restarted, node states
and reputation, the newest health results, a capacity plan for a traffic pattern (``gpufleet serve
plan``), serve-bench summaries. Resources: each run's ledger and report, the fleet ledger.

With ``allow_actions`` three more tools exist: drain a node, stop a run, start a health check. Each
needs ``requested_by`` and is recorded in the fleet ledger as an ``operator_action`` event, whether it
was done, refused or failed. A drain keeps the owned-reason rules of the node actions
(:mod:`gpufleet.health.actions`): the reason starts with ``gpufleet:``; a node someone else (an admin)
took out is left alone; with a platform's node actions (``McpConfig.node_actions``: Slurm's with
``gpufleet mcp --slurm``) the drain isolates the node there, behind the circuit breaker.

Answers carry no command lines, configurations or environment: ledgers served as resources have
``run_start.command`` and ``run_start.config`` removed. Tool inputs are validated (types, patterns,
known names); a bad one is an MCP tool error with one line of explanation, never a crash.
"""

# No ``from __future__ import annotations`` here: the SDK reads the tools' signatures, whose types
# (``Name``, ``Context``) are local to build_server and must be real objects, not strings.
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from gpufleet.core import events as E
from gpufleet.core.ledger import LEDGER_NAME, Ledger, iter_events, read_events
from gpufleet.observe.sources import RunSource, ServeSource, Sources, newest

if TYPE_CHECKING:
    from collections.abc import Callable

    from mcp.server.mcpserver import MCPServer

    from gpufleet.health.actions import NodeActions

__all__ = ["McpConfig", "build_server", "explain_failures", "READ_TOOLS", "ACTION_TOOLS"]

READ_TOOLS = (
    "list_runs",
    "run_report",
    "explain_failures",
    "node_states",
    "health_results",
    "capacity_plan",
    "serve_bench_summaries",
)
ACTION_TOOLS = ("drain_node", "stop_run", "start_health_check")
NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9._@/#:-]{0,127}$"  # run, bench and node names; requested_by
REDACT = ("command", "config")  # run_start fields an answer never carries
GPUFLEET = [sys.executable, "-m", "gpufleet.cli.main"]


@dataclass(kw_only=True, slots=True)
class McpConfig:
    """What the server may read, and whether it may act."""

    dirs: list[Path] = field(default_factory=list)
    """Run directories, serve-bench directories, or directories of those."""
    fleet_dir: Path | None = None
    """The fleet state directory (node states, health results, the audit trail)."""
    serve_dirs: list[Path] = field(default_factory=list)
    """Serve-bench output directories."""
    allow_actions: bool = False
    """Register the mutating tools (drain_node, stop_run, start_health_check)."""
    node_actions: "Callable[[Path], NodeActions] | None" = None
    """drain_node isolates the node on its platform too: the platform's node actions for a fleet
    directory (owned reason, admin isolations left alone, the breaker). None: the fleet ledger only."""
    action_timeout_s: float = 120.0
    """How long a started health check or capacity plan may take."""


class _Catalog:
    """Runs and benches by name (the exporter's discovery and names), found again at each call."""

    def __init__(self, cfg: McpConfig) -> None:
        self.cfg = cfg
        self.sources = Sources(cfg.dirs, serve_dirs=cfg.serve_dirs)
        self.lock = threading.Lock()  # tools may run in worker threads; sources read one at a time

    def run_sources(self) -> list[RunSource]:
        self.sources.discover()
        return sorted((s for s in self.sources.all if isinstance(s, RunSource)), key=lambda s: s.name)

    def runs(self) -> dict[str, Path]:
        with self.lock:
            self.sources.discover()
        return {s.name: s.dir for s in self.sources.all if isinstance(s, RunSource)}

    def benches(self) -> dict[str, Path]:
        with self.lock:
            self.sources.discover()
        return {s.name: s.dir for s in self.sources.all if isinstance(s, ServeSource)}

    def run(self, name: str) -> Path:
        runs = self.runs()
        if name not in runs:
            raise _err(f"unknown run {name!r}; known runs: {', '.join(sorted(runs)) or '(none)'}")
        if not (runs[name] / LEDGER_NAME).is_file():
            raise _err(f"run {name!r} has no ledger yet")
        return runs[name]

    def fleet(self) -> Path:
        if self.cfg.fleet_dir is None:
            raise _err("no fleet directory configured (start gpufleet mcp with --fleet-dir)")
        return self.cfg.fleet_dir


def _err(message: str) -> Exception:
    from mcp.server.mcpserver.exceptions import ToolError

    return ToolError(message)


# ---------------------------------------------------------------------------------- read-only
def run_overview(src: RunSource) -> dict[str, Any]:
    """One row of list_runs, from the exporter's incremental reading of the run (report's numbers)."""
    src.refresh()
    if not src.tail.events:
        return {"run": src.name, "status": "empty"}
    scalars = src.derived.get("scalars", {})
    labelled = src.derived.get("labelled", {})
    return {
        "run": src.name,
        "status": src.status or "running",
        "sessions": src.sessions,
        "restarts": int(sum(labelled.get("gpufleet_train_restarts_total", {}).values())),
        "failures": int(sum(labelled.get("gpufleet_train_failures_total", {}).values())),
        "goodput": scalars.get("gpufleet_train_goodput_ratio"),
        "last_step": scalars.get("gpufleet_train_last_step"),
        "last_event_t": src.last_t,
    }


def explain_failures(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Why a run failed and restarted: every incident with its cause, rank, node, step, what was seen,
    whether and how fast it recovered, and how each session ended (breakers give their reason)."""
    from gpufleet.reliability.metrics import summarize

    s = summarize(events)
    typed = [E.parse_event(e) for e in events]
    failures = [e for e in typed if isinstance(e, E.Failure)]
    give_ups = [e for e in typed if isinstance(e, E.GiveUp)]
    lost = [e for e in typed if isinstance(e, E.NodeLost | E.SlotDropped)]
    rollbacks = [e for e in typed if isinstance(e, E.Rollback)]
    incidents = []
    for inc in s["incidents"]:
        f = next(
            (x for x in failures if x.attempt == inc["attempt"] and x.rank == inc["rank"]
             and abs(x.t - inc["detected_t"]) < 1e-6), None,
        )  # fmt: skip
        incidents.append(
            {
                "cause": inc["cause"],
                "attempt": inc["attempt"],
                "rank": inc["rank"],
                "node": f.node if f else None,
                "step": inc["step"],
                "what": f.detail if f else "",
                "recovered": inc["recovered"],
                "mttr_s": inc["mttr_s"],
                "phases_s": inc["phases_s"],
                "resumed_at_step": inc["restore_step"],
                "lost_steps": inc["lost_steps"],
            }
        )
    lines = []
    for i in incidents:
        where = f"rank {i['rank']}" + (f" on {i['node']}" if i["node"] else "")
        rec = (
            f"recovered in {i['mttr_s']:.1f} s"
            if i["recovered"] and i["mttr_s"] is not None
            else "not recovered"
        )
        lines.append(f"{i['cause']} of {where} at step {i['step']} ({i['what'] or 'no detail'}): {rec}")
    for g in give_ups:
        lines.append(f"gave up: {g.reason}")
    return {
        "restarts": s["restarts"],
        "failures_by_cause": s["failures"]["by_cause"],
        "unrecovered": s["failures"]["unrecovered"],
        "mttr_mean_s": s["mttr"]["mean_s"],
        "incidents": incidents,
        "rollbacks": [
            {"from_step": r.from_step, "to_step": r.to_step, "mode": str(r.mode)} for r in rollbacks
        ],
        "nodes_lost": [
            {"node": getattr(e, "node", None), "slot": getattr(e, "slot", None), "reason": e.reason}
            for e in lost
        ],
        "sessions": [
            {"status": x["status"], "exit_code": x["exit_code"], "restarts": x["restarts"]}
            for x in s["sessions"]
        ],  # fmt: skip
        "gave_up": [g.reason for g in give_ups],
        "summary": "; ".join(lines) or "no failures",
    }


def redacted_ledger(path: Path) -> str:
    """A ledger as JSONL without the fields that may hold command lines or configuration."""
    out = []
    for rec in iter_events(path):
        if rec.get("ev") == E.RunStart.kind:
            rec = {k: v for k, v in rec.items() if k not in REDACT}
        out.append(json.dumps(rec, separators=(",", ":"), default=str))
    return "\n".join(out) + ("\n" if out else "")


def health_latest(fleet: Path, node: str | None = None) -> list[dict[str, Any]]:
    latest: dict[tuple[str, str, str], dict[str, Any]] = {}
    for e in iter_events(fleet):
        if e.get("ev") != E.HealthResult.kind or (node is not None and e.get("node") != node):
            continue
        key = (str(e.get("node")), str(e.get("check")), str(e.get("device") or ""))
        if key not in latest or float(latest[key].get("t", 0)) <= float(e.get("t", 0)):
            latest[key] = e
    now = time.time()
    keep = (
        "node",
        "check",
        "device",
        "status",
        "value",
        "unit",
        "threshold",
        "detail",
        "hint",
        "component",
        "t",
    )
    rows = []
    for _, e in sorted(latest.items()):
        row = {k: e.get(k) for k in keep}
        row["expired"] = float(e.get("valid_until", 0)) < now
        rows.append(row)
    return rows


def _bench_summary(name: str, d: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"bench": name}
    s_path, c_path = newest(d, "summary.json"), newest(d, "capacity.json")
    if s_path is not None:
        s = json.loads(s_path.read_text())
        out["summary"] = {
            "created_unix": s.get("created_unix"),
            "valid": s.get("valid"),
            "model": (s.get("target") or {}).get("model"),
            "load": {k: (s.get("load") or {}).get(k) for k in ("mode", "rate", "concurrency", "sent")},
            "requests": s.get("requests"),
            "latency_ms": {
                k: {p: v.get(p) for p in ("p50", "p90", "p99")}
                for k, v in (s.get("latency_ms") or {}).items()
            },
            "slo": {k: (s.get("slo") or {}).get(k) for k in ("limits_ms", "attainment", "goodput_per_s")},
            "throughput_per_s": (s.get("rate") or {}).get("request_throughput_per_s"),
            "flags": s.get("flags"),
        }
    if c_path is not None:
        c = json.loads(c_path.read_text())
        out["capacity"] = {
            k: c.get(k) for k in ("max_rate", "target_attainment", "slo", "limited_by", "stable")
        }
    return out


# ---------------------------------------------------------------------------------- actions
def _audit(fleet: Path, action: E.OperatorActionKind, target: str, who: str, result: E.ActionResult,
           detail: str, client: str | None) -> None:  # fmt: skip
    with Ledger(fleet) as ledger:
        ledger.emit(
            E.OperatorAction(
                action=action,
                target=target,
                requested_by=who,
                result=result,
                client=client,
                detail=detail[:500],
            )
        )


def supervisor_pid(run_dir: Path) -> int | None:
    """The pid of the ``gpufleet run`` supervising ``run_dir`` on this host, or None.

    Found as the parent of the newest attempt's workers (the grandparent of one forked by the run's warm
    interpreter, train/zygote.py), and accepted only when that process is a ``gpufleet ... run`` whose
    ``--run-dir`` is this directory (its command line is read, never shown).
    """
    events = read_events(run_dir)
    starts = [e for e in events if e.get("ev") == E.AttemptStart.kind]
    if not starts or E.RunEnd.kind in {e.get("ev") for e in events[events.index(starts[-1]) :]}:
        return None
    want = run_dir.resolve()
    for pid in starts[-1].get("pids") or ():
        try:
            parent = _parent(int(pid))
        except ValueError:
            continue
        for candidate in (parent, _parent(parent) if parent else None):
            if candidate and _supervises(candidate, want):
                return candidate
    return None


def _parent(pid: int) -> int | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    m = re.search(r"^PPid:\s+(\d+)", status, re.M)
    return int(m.group(1)) if m else None


def _supervises(pid: int, run_dir: Path) -> bool:
    """Whether ``pid`` is a ``gpufleet ... run`` whose ``--run-dir`` resolves to ``run_dir``."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        cwd = Path(os.readlink(f"/proc/{pid}/cwd"))
    except OSError:
        return False
    args = [a.decode(errors="replace") for a in argv if a]
    if "run" not in args or not any("gpufleet" in a for a in args):
        return False
    value = "runs/default"  # gpufleet run's default --run-dir
    for i, a in enumerate(args):
        if a.startswith("--run-dir="):
            value = a.split("=", 1)[1]
        elif a == "--run-dir" and i + 1 < len(args):
            value = args[i + 1]
    return (cwd / value).resolve() == run_dir


def _drain(
    fleet: Path, node: str, reason: str, who: str, actions: "NodeActions | None"
) -> tuple[E.ActionResult, str]:
    """Drain with an owned reason; leave nodes someone else took out alone."""
    from gpufleet.health.actions import NodeActionError, make_reason
    from gpufleet.health.nodes import DOWN_STATES, current_state, record_state

    detail = f"{reason} (asked by {who} via MCP)"
    if actions is not None:
        try:
            ok = actions.isolate(node, check="mcp", detail=detail)
        except NodeActionError as e:
            return E.ActionResult.FAILED, str(e)
        if not ok:
            return (
                E.ActionResult.REFUSED,
                "not drained: taken out by someone else, or the circuit breaker is open",
            )
        return E.ActionResult.DONE, f"drained in {actions.platform}: {make_reason('mcp', detail)}"
    cur = current_state(node, fleet)
    if cur is not None and cur.get("state") in DOWN_STATES and cur.get("by") == "admin":
        return (
            E.ActionResult.REFUSED,
            f"{node} was taken out by an admin ({cur.get('state')}): not gpufleet's to touch",
        )
    if cur is not None and cur.get("state") == "drained":
        return E.ActionResult.DONE, f"{node} is already drained by gpufleet"
    record_state(node, "drained", make_reason("mcp", detail), check="mcp", fleet=fleet)
    return E.ActionResult.DONE, f"{node} drained in the fleet ledger (no Slurm on this host)"


def _cli(args: list[str], timeout: float) -> dict[str, Any]:
    """Run a ``gpufleet`` command that prints JSON; a usage error becomes a tool error."""
    try:
        p = subprocess.run([*GPUFLEET, *args], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise _err(f"gpufleet {args[0]} took longer than {timeout:.0f} s") from None
    if p.returncode == 2:
        line = (p.stderr.strip().splitlines() or ["bad arguments"])[-1]
        raise _err(line.removeprefix("gpufleet: error: "))
    try:
        out = json.loads(p.stdout)
    except ValueError:
        line = (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]
        raise _err(f"gpufleet {args[0]} failed: {line}") from None
    out["exit_code"] = p.returncode
    return out


def _client_name(ctx: Any) -> str | None:
    try:
        info = ctx.session.client_params.client_info
        return str(info.name)[:100] if info is not None else None
    except Exception:  # noqa: BLE001 - best effort: transports differ in what they keep
        return None


# ---------------------------------------------------------------------------------- the server
def build_server(cfg: McpConfig) -> "MCPServer":
    """The MCP server: read-only tools and resources, and the actions when ``cfg.allow_actions``."""
    from mcp.server.mcpserver import Context, MCPServer
    from mcp_types import ToolAnnotations
    from pydantic import Field

    cat = _Catalog(cfg)
    Name = Annotated[str, Field(pattern=NAME_RE, description="A name as list_runs / node_states show it.")]
    Who = Annotated[
        str, Field(pattern=NAME_RE, description="Who asks for this (a person or a ticket), audited.")
    ]
    ro = ToolAnnotations(read_only_hint=True, destructive_hint=False, open_world_hint=False)
    mcp = MCPServer(
        "gpufleet",
        log_level="WARNING",
        instructions="gpufleet: training runs (ledgers, reports, failures), the fleet (node states, "
        "health results) and serving (capacity plans, benchmark summaries). Read-only unless the "
        "server was started with --allow-actions.",
    )

    @mcp.tool(annotations=ro)
    def list_runs() -> dict[str, Any]:
        """Every run this server knows: status, sessions, restarts, failures, goodput, newest step."""
        with cat.lock:
            return {"runs": [run_overview(src) for src in cat.run_sources()]}

    @mcp.tool(annotations=ro)
    def run_report(run: Name) -> dict[str, Any]:
        """A run's reliability report (gpufleet report --json): MTBF, MTTR with phases, goodput, badput,
        checkpoints, incidents."""
        from gpufleet.reliability.metrics import summarize

        d = cat.run(run)
        return summarize(read_events(d), run_dir=run)

    @mcp.tool(name="explain_failures", annotations=ro)
    def explain_failures_tool(run: Name) -> dict[str, Any]:
        """Why a run restarted or stopped: each failure's cause, rank, node, step and what was seen, how it
        recovered (MTTR and phases), rollbacks, lost nodes, and the breaker that gave up, with a summary."""
        return explain_failures(read_events(cat.run(run)))

    @mcp.tool(annotations=ro)
    def node_states(lemons_only: bool = False) -> dict[str, Any]:
        """Node states and reputation from the fleet ledger (gpufleet nodes --json): state, reason, MTBF,
        MTTR, failures by component, lemon flag; and the exclude list (drained, suspect, repaired, lemons)."""
        from gpufleet.health.nodes import exclude_list, node_table

        fleet = cat.fleet()
        rows = [r.to_dict() for r in node_table(fleet) if r.lemon or not lemons_only]
        drained = [r["node"] for r in rows if r["state"] == "drained"]
        return {"nodes": rows, "drained": drained, "exclude": exclude_list(fleet)}

    @mcp.tool(annotations=ro)
    def health_results(node: Name | None = None) -> dict[str, Any]:
        """The newest health-check result per node, check and device (status, value, threshold, hint)."""
        return {"results": health_latest(cat.fleet(), node)}

    @mcp.tool(annotations=ro)
    def capacity_plan(
        traffic: Annotated[
            str, Field(max_length=300, description="rate=12;in=lognormal:512,0.6;out=fixed:128;cv=1")
        ],
        profile: Annotated[
            str,
            Field(
                pattern=r"^[A-Za-z0-9._-]{1,80}$",
                description="A shipped latency profile (gpufleet serve profile --list)",
            ),
        ] = ("llama3-8b-h100"),
        slo: Annotated[str, Field(pattern=r"^[a-z0-9_=.,]{1,100}$")] = "ttft_p90=500ms,tpot_p90=50ms",
        attainment: Annotated[float, Field(gt=0, le=1)] = 0.9,
        mode: Annotated[str, Field(pattern=r"^(both|aggregated|disaggregated)$")] = "both",
        gpus_per_node: Annotated[int, Field(ge=1, le=1024)] = 8,
    ) -> dict[str, Any]:
        """GPUs needed for a traffic pattern and SLO (gpufleet serve plan): aggregated vs disaggregated,
        tensor parallelism, batch, replicas, predicted latency and max rate."""
        if ";" not in traffic and "=" not in traffic:
            raise _err("traffic must be a spec such as rate=12;in=lognormal:512,0.6;out=fixed:128;cv=1")
        args = ["serve", "plan", "--profile", profile, "--traffic", traffic, "--slo", slo, "--attainment",
                str(attainment), "--mode", mode, "--gpus-per-node", str(gpus_per_node),
                "--sim-requests", "500",
                "--json"]  # fmt: skip
        doc = _cli(args, cfg.action_timeout_s)
        keep = (
            "feasible",
            "config",
            "gpus",
            "slo",
            "traffic",
            "predicted",
            "profile",
            "runners_up",
            "exit_code",
        )
        return {k: doc.get(k) for k in keep}

    @mcp.tool(annotations=ro)
    def serve_bench_summaries() -> dict[str, Any]:
        """The newest serve-bench summary (latency percentiles, SLO attainment, goodput) and capacity curve
        of each benchmark directory."""
        return {"benches": [_bench_summary(n, d) for n, d in sorted(cat.benches().items())]}

    @mcp.resource("gpufleet://runs/{run}/ledger", mime_type="application/x-ndjson")
    def run_ledger(run: str) -> str:
        """A run's ledger (JSONL), without command lines and configuration."""
        return redacted_ledger(cat.run(run) / LEDGER_NAME)

    @mcp.resource("gpufleet://runs/{run}/report", mime_type="application/json")
    def run_report_resource(run: str) -> str:
        """A run's report (gpufleet report --json)."""
        from gpufleet.reliability.metrics import summarize

        return json.dumps(summarize(read_events(cat.run(run)), run_dir=run), default=str)

    @mcp.resource("gpufleet://fleet/ledger", mime_type="application/x-ndjson")
    def fleet_ledger() -> str:
        """The fleet ledger (JSONL): node states, health results, Slurm actions, operator actions."""
        return redacted_ledger(cat.fleet() / LEDGER_NAME)

    if cfg.allow_actions:
        act = ToolAnnotations(read_only_hint=False, destructive_hint=True, open_world_hint=False)

        @mcp.tool(annotations=act)
        def drain_node(
            node: Name,
            reason: Annotated[str, Field(min_length=3, max_length=200)],
            requested_by: Who,
            ctx: Context,
        ) -> dict[str, Any]:
            """Take a node out of service (owned reason "gpufleet: mcp: ..."). A node an admin drained is
            left alone; on a platform (Slurm), the circuit breaker applies. Audited in the fleet ledger."""
            fleet = cat.fleet()
            acts = cfg.node_actions(fleet) if cfg.node_actions is not None else None
            result, detail = _drain(fleet, node, " ".join(reason.split()), requested_by, acts)
            _audit(
                fleet, E.OperatorActionKind.DRAIN_NODE, node, requested_by, result, detail, _client_name(ctx)
            )
            return {"node": node, "result": str(result), "detail": detail}

        @mcp.tool(annotations=act)
        def stop_run(run: Name, requested_by: Who, ctx: Context) -> dict[str, Any]:
            """Ask a running run's supervisor (this host) to stop cleanly: SIGTERM, a final checkpoint at the
            next step boundary, exit 0. Audited in the fleet ledger."""
            fleet = cat.fleet()
            d = cat.run(run)
            pid = supervisor_pid(d)
            if pid is None:
                result, detail = E.ActionResult.REFUSED, f"{run} has no running supervisor on this host"
            else:
                try:
                    os.kill(pid, signal.SIGTERM)
                    result, detail = E.ActionResult.DONE, f"asked the supervisor of {run} to stop (SIGTERM)"
                except OSError as e:
                    result, detail = E.ActionResult.FAILED, f"could not signal the supervisor: {e.strerror}"
            _audit(fleet, E.OperatorActionKind.STOP_RUN, run, requested_by, result, detail, _client_name(ctx))
            return {"run": run, "result": str(result), "detail": detail}

        @mcp.tool(annotations=act)
        def start_health_check(
            node: Name,
            requested_by: Who,
            ctx: Context,
            plan: Annotated[str, Field(pattern=r"^(quick|postfail|acceptance)$")] = "quick",
            profile: Annotated[str, Field(pattern=r"^[A-Za-z0-9]{1,16}$")] | None = None,
        ) -> dict[str, Any]:
            """Run a health-check plan on this host, recorded under ``node`` in the fleet ledger; returns each
            check's status. Audited in the fleet ledger."""
            fleet = cat.fleet()
            args = ["health", "check", "--plan", plan, "--node", node, "--fleet-dir", str(fleet), "--json"]
            if profile:
                args += ["--profile", profile]
            try:
                rep = _cli(args, cfg.action_timeout_s)
            except Exception as e:  # any failure is audited as FAILED, then re-raised to the MCP client
                kind = E.OperatorActionKind.START_HEALTH_CHECK
                _audit(fleet, kind, node, requested_by, E.ActionResult.FAILED,
                       str(e), _client_name(ctx))  # fmt: skip
                raise
            results = [
                {k: r.get(k) for k in ("check", "device", "status", "detail")} for r in rep.get("results", [])
            ]
            worst = rep.get("status") or ("FAIL" if any(r["status"] == "FAIL" for r in results) else "OK")
            detail = f"plan {plan}: {worst}, {len(results)} results"
            kind = E.OperatorActionKind.START_HEALTH_CHECK
            _audit(fleet, kind, node, requested_by, E.ActionResult.DONE, detail,
                   _client_name(ctx))  # fmt: skip
            return {"node": node, "plan": plan, "status": worst, "results": results}

    return mcp

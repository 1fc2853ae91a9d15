"""Slurm node actions: drain and resume with an owned reason prefix, guarded by a circuit breaker.

Ownership (as NHC does with ``NHC:``): gpufleet drains with a reason ``gpufleet: <check>: <detail>``
and only ever resumes a node whose current reason starts with ``gpufleet:``. A node an administrator
drained (any other reason) is left alone: not re-drained over, never resumed.

Circuit breaker: when more than ``max_fraction`` of the cluster's nodes were isolated by gpufleet
within ``window_s`` (defaults 50 % in 5 min, as NVSentinel), a mass failure is more likely a fabric,
storage or software problem than N bad nodes, so further drains are refused and an alert is raised
instead (a ``slurm_breaker_open`` event in the fleet ledger and the caller's sink, plus a stderr
line). Isolations are ``slurm_action`` events in the fleet ledger, so every process on every node
(supervisors, HealthCheckProgram runs) shares one breaker.

Every Slurm command runs with a timeout. ``python -m gpufleet.health.slurm healthcheck`` is the
body of the HealthCheckProgram that ``gpufleet health slurm-config`` writes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gpufleet.core import events as E
from gpufleet.core.env import Env, Platform, read_env
from gpufleet.core.exitcodes import ExitCode
from gpufleet.core.ledger import EventSink, Ledger, read_events

__all__ = [
    "PREFIX",
    "SlurmError",
    "NodeInfo",
    "Breaker",
    "SlurmActions",
    "node_info",
    "cluster_nodes",
    "owned",
    "make_reason",
]

PREFIX = "gpufleet:"
ACTION_EV = E.SlurmAction.kind
BREAKER_EV = E.SlurmBreakerOpen.kind
SKIP_EV = E.SlurmActionSkipped.kind
DEFAULT_TIMEOUT_S = 15.0


class SlurmError(RuntimeError):
    """A Slurm command failed or timed out."""


def run_slurm(argv: Sequence[str], timeout: float = DEFAULT_TIMEOUT_S) -> str:
    """Run one Slurm command; stdout on success, :class:`SlurmError` with its stderr otherwise."""
    try:
        p = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as e:
        raise SlurmError(f"{argv[0]} timed out after {timeout:.0f}s") from e
    except FileNotFoundError as e:
        raise SlurmError(f"{argv[0]} not found (is Slurm installed and on PATH?)") from e
    if p.returncode != 0:
        raise SlurmError(f"{' '.join(argv[:3])}: {p.stderr.strip() or f'exit {p.returncode}'}")
    return p.stdout


@dataclass(frozen=True)
class NodeInfo:
    name: str
    state: str  # sinfo %T, e.g. idle, allocated, drained, draining, down*, mixed
    reason: str  # "" when none ("none" from sinfo)

    @property
    def drained(self) -> bool:
        return self.state.rstrip("*~#!%$@^-").startswith(("drain", "drng"))

    @property
    def owned(self) -> bool:
        return owned(self.reason)


def owned(reason: str) -> bool:
    return reason.strip().startswith(PREFIX)


def make_reason(check: str, detail: str) -> str:
    """``gpufleet: <check>: <detail>`` on one line, short enough for Slurm's reason field."""
    detail = " ".join(detail.split())
    return f"{PREFIX} {check}: {detail}"[:200]


def parse_sinfo_nodes(text: str) -> list[NodeInfo]:
    """Parse ``sinfo -h -N -o '%N|%T|%E'`` (reason last: it may hold any character)."""
    out: dict[str, NodeInfo] = {}
    for line in text.splitlines():
        parts = line.split("|", 2)
        if len(parts) < 3 or not parts[0].strip():
            continue
        reason = parts[2].strip()
        name = parts[0].strip()
        out[name] = NodeInfo(name, parts[1].strip(), "" if reason == "none" else reason)
    return list(out.values())  # a node in two partitions is listed twice by sinfo -N


def node_info(node: str, timeout: float = DEFAULT_TIMEOUT_S) -> NodeInfo:
    rows = parse_sinfo_nodes(run_slurm(["sinfo", "-h", "-N", "-n", node, "-o", "%N|%T|%E"], timeout))
    for r in rows:
        if r.name == node:
            return r
    raise SlurmError(f"sinfo does not know node {node!r}")


def cluster_nodes(timeout: float = DEFAULT_TIMEOUT_S) -> list[NodeInfo]:
    return parse_sinfo_nodes(run_slurm(["sinfo", "-h", "-N", "-o", "%N|%T|%E"], timeout))


class Breaker:
    """Refuses isolations once more than ``max_fraction`` of nodes were hit within ``window_s``."""

    def __init__(
        self,
        fleet: str | os.PathLike[str] | None = None,
        max_fraction: float | None = None,
        window_s: float | None = None,
    ) -> None:
        from gpufleet.health.nodes import fleet_dir

        self.dir = fleet_dir(fleet)
        if max_fraction is None:
            max_fraction = read_env(Env.BREAKER_FRACTION, float, 0.5)
        self.max_fraction = max_fraction
        self.window_s = window_s if window_s is not None else read_env(Env.BREAKER_WINDOW_S, float, 300.0)

    def recent(self, now: float | None = None) -> set[str]:
        """Nodes gpufleet drained within the window."""
        now = time.time() if now is None else now
        return {
            str(e["node"])
            for e in read_events(self.dir)
            if e.get("ev") == ACTION_EV
            and e.get("action") == "drain"
            and now - float(e.get("t", 0.0)) <= self.window_s
        }

    def allows(self, node: str, total: int, now: float | None = None) -> tuple[bool, int]:
        """(allowed, nodes hit including this one)."""
        hit = len(self.recent(now) | {node})
        return (total > 0 and hit / total <= self.max_fraction), hit


class SlurmActions:
    """Drain / resume nodes gpufleet owns; every action is an event in the fleet ledger and ``sink``."""

    def __init__(
        self,
        sink: EventSink | None = None,
        fleet: str | os.PathLike[str] | None = None,
        breaker: Breaker | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.sink = sink
        self.fleet = fleet
        self.breaker = breaker or Breaker(fleet)
        self.timeout = timeout

    def _emit(self, event: E.Event) -> None:
        from gpufleet.health.nodes import fleet_dir

        with Ledger(fleet_dir(self.fleet)) as fl:
            fl.emit(event)
        if self.sink is not None:
            self.sink.emit(event)

    def drain(self, node: str, check: str, detail: str, component: str = "unknown") -> bool:
        """Drain ``node`` with an owned reason. False when skipped (admin drain, breaker open)."""
        info = node_info(node, self.timeout)
        if info.drained and not info.owned:
            why = f"drained by someone else: {info.reason}"
            self._emit(E.SlurmActionSkipped(node=node, action=E.SlurmActionKind.DRAIN, why=why))
            return False
        if info.drained:  # already isolated by gpufleet: nothing to do, and not a new hit
            return True
        total = len(cluster_nodes(self.timeout))
        ok, hit = self.breaker.allows(node, total)
        if not ok:
            self._emit(
                E.SlurmBreakerOpen(
                    node=node,
                    hit=hit,
                    total=total,
                    window_s=self.breaker.window_s,
                    max_fraction=self.breaker.max_fraction,
                    check=check,
                    detail=detail,
                )
            )
            print(
                f"gpufleet: ALERT: circuit breaker open: {hit}/{total} nodes hit within "
                f"{self.breaker.window_s:.0f}s; not draining {node} ({check}: {detail})",
                file=sys.stderr,
            )
            return False
        reason = make_reason(check, detail)
        run_slurm(["scontrol", "update", f"nodename={node}", "state=drain", f"reason={reason}"], self.timeout)
        self._emit(E.SlurmAction(node=node, action=E.SlurmActionKind.DRAIN, reason=reason, check=check))
        _record(node, "drained", reason, component=component, check=check, fleet=self.fleet)
        return True

    def resume(self, node: str, why: str = "resumed by gpufleet", only_check: str | None = None) -> bool:
        """Resume ``node`` only if gpufleet drained it (its reason carries the prefix).

        ``only_check``: resume only drains made for that check (``gpufleet: <check>: ...``).
        """
        info = node_info(node, self.timeout)
        mine = info.owned and (only_check is None or info.reason.startswith(make_reason(only_check, "")))
        if not mine:
            if info.drained or info.reason:
                why = f"not ours: {info.reason}"
                self._emit(E.SlurmActionSkipped(node=node, action=E.SlurmActionKind.RESUME, why=why))
            return False
        run_slurm(["scontrol", "update", f"nodename={node}", "state=resume"], self.timeout)
        self._emit(
            E.SlurmAction(node=node, action=E.SlurmActionKind.RESUME, reason=why, previous=info.reason)
        )
        _record(node, "repaired", why, component="unknown", check=None, fleet=self.fleet)
        return True


def _record(node: str, state: str, reason: str, *, component: str, check: str | None, fleet: Any) -> None:
    from gpufleet.health.nodes import COMPONENTS, record_state

    record_state(
        node,
        state,
        reason,
        component=component if component in COMPONENTS else "unknown",
        check=check,
        fleet=fleet,
    )


# ---------------------------------------------------------------- HealthCheckProgram body
def healthcheck(node: str, command: list[str], timeout: float = 50.0) -> int:
    """Run the check; drain on exit 1 (problem), resume on 0, do nothing otherwise (undecided).

    On a pass it resumes only nodes it drained itself (``gpufleet: health: ...``): a node the
    supervisor isolated (``gpufleet: node-lost: ...``) waits for a deeper check or an operator.

    Slurm ignores the HealthCheckProgram's exit code, so the program acts itself. slurmd kills it
    after 60 s, hence the check's own 50 s timeout. Returns the check's exit code.
    """
    try:
        p = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
        rc, out = p.returncode, (p.stdout + p.stderr).strip()
    except subprocess.TimeoutExpired:
        rc, out = 3, f"check timed out after {timeout:.0f}s"
    except OSError as e:
        rc, out = 3, f"check could not start: {e.strerror}"
    actions = SlurmActions()
    detail = next((ln for ln in reversed(out.splitlines()) if ln.strip()), f"exit {rc}")
    try:
        if rc == 1:
            actions.drain(node, "health", detail, component="unknown")
        elif rc == 0:
            actions.resume(node, why="health check passed", only_check="health")
    except SlurmError as e:
        print(f"gpufleet: healthcheck on {node}: {e}", file=sys.stderr)
    return rc


def _main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "healthcheck" or "--" not in argv:
        print(
            "usage: python -m gpufleet.health.slurm healthcheck [NODE] -- CHECK_COMMAND ...", file=sys.stderr
        )
        return ExitCode.USAGE
    sep = argv.index("--")
    node = argv[1] if sep > 1 else Platform.SLURMD_NODENAME.get()
    if not node:
        print("gpufleet: healthcheck: no node name (SLURMD_NODENAME unset)", file=sys.stderr)
        return ExitCode.USAGE
    return healthcheck(node, argv[sep + 1 :])


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))

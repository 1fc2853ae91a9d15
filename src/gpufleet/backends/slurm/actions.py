"""Slurm node actions: drain (isolate) and resume (release) with an owned reason, behind the breaker.

The rules are the node actions' (:mod:`gpufleet.health.actions`): gpufleet drains with a reason
``gpufleet: <check>: <detail>`` and only ever resumes a node whose current reason starts with
``gpufleet:``; a node an administrator drained (any other reason) is left alone, not re-drained over and
never resumed; the one circuit breaker refuses drains past its limit, with a ``node_action`` (refused)
and an ALERT line. Every decision is a ``node_action`` event (``platform: slurm``).

Every Slurm command runs with a timeout. ``python -m gpufleet.backends.slurm healthcheck`` is the
body of the HealthCheckProgram that ``gpufleet health slurm-config`` writes (:func:`healthcheck`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from gpufleet.core import events as E
from gpufleet.core.env import Platform
from gpufleet.core.exitcodes import ExitCode
from gpufleet.core.ledger import EventSink
from gpufleet.health.actions import Breaker, NodeActionError, NodeActions, make_reason, owned

__all__ = [
    "SlurmError",
    "NodeInfo",
    "SlurmActions",
    "node_info",
    "cluster_nodes",
    "run_slurm",
    "healthcheck",
    "main",
]

DEFAULT_TIMEOUT_S = 15.0


class SlurmError(NodeActionError):
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


class SlurmActions(NodeActions):
    """Drain (isolate) and resume (release) Slurm nodes gpufleet owns (see the module doc)."""

    platform: ClassVar[E.NodePlatform] = E.NodePlatform.SLURM

    def __init__(
        self,
        sink: EventSink | None = None,
        fleet: str | os.PathLike[str] | None = None,
        breaker: Breaker | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        super().__init__(sink, fleet, breaker)
        self.timeout = timeout

    def isolate(self, node: str, check: str, detail: str, component: str = "unknown") -> bool:
        """Drain ``node`` with an owned reason. False when refused (an admin's drain, breaker open);
        :class:`SlurmError` (recorded as failed) when a Slurm command fails."""
        isolate = E.NodeActionKind.ISOLATE
        try:
            info = node_info(node, self.timeout)
            if info.drained and not info.owned:
                why = f"drained by someone else: {info.reason}"
                self.record(node, isolate, E.ActionResult.REFUSED, why, check=check)
                return False
            if info.drained:  # already isolated by gpufleet: nothing to do, and not a new hit
                return True
            if not self.guard(node, len(cluster_nodes(self.timeout)), check, detail):
                return False
            reason = make_reason(check, detail)
            drain = ["scontrol", "update", f"nodename={node}", "state=drain", f"reason={reason}"]
            run_slurm(drain, self.timeout)
        except SlurmError as e:
            self.record(node, isolate, E.ActionResult.FAILED, str(e), check=check)
            raise
        self.record(node, isolate, E.ActionResult.DONE, reason, check=check)
        self.mark(node, "drained", reason, component=component, check=check)
        return True

    def release(self, node: str, why: str = "resumed by gpufleet", only_check: str | None = None) -> bool:
        """Resume ``node`` only if gpufleet drained it (its reason carries the prefix).

        ``only_check``: resume only drains made for that check (``gpufleet: <check>: ...``).
        """
        release = E.NodeActionKind.RELEASE
        try:
            info = node_info(node, self.timeout)
            mine = info.owned and (only_check is None or info.reason.startswith(make_reason(only_check, "")))
            if not mine:
                if info.drained or info.reason:
                    self.record(node, release, E.ActionResult.REFUSED, f"not ours: {info.reason}")
                return False
            run_slurm(["scontrol", "update", f"nodename={node}", "state=resume"], self.timeout)
        except SlurmError as e:
            self.record(node, release, E.ActionResult.FAILED, str(e))
            raise
        self.record(node, release, E.ActionResult.DONE, why, previous=info.reason)
        self.mark(node, "repaired", why)
        return True


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
            actions.isolate(node, "health", detail, component="unknown")
        elif rc == 0:
            actions.release(node, why="health check passed", only_check="health")
    except SlurmError as e:
        print(f"gpufleet: healthcheck on {node}: {e}", file=sys.stderr)
    return rc


def main(argv: list[str]) -> int:
    """``python -m gpufleet.backends.slurm healthcheck [NODE] -- CHECK ...``."""
    if len(argv) < 2 or argv[0] != "healthcheck" or "--" not in argv:
        usage = "usage: python -m gpufleet.backends.slurm healthcheck [NODE] -- CHECK_COMMAND ..."
        print(usage, file=sys.stderr)
        return ExitCode.USAGE
    sep = argv.index("--")
    node = argv[1] if sep > 1 else Platform.SLURMD_NODENAME.get()
    if not node:
        print("gpufleet: healthcheck: no node name (SLURMD_NODENAME unset)", file=sys.stderr)
        return ExitCode.USAGE
    return healthcheck(node, argv[sep + 1 :])

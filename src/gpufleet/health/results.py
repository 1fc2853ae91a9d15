"""Check results, the plan report, its versioned JSON form and the exit code.

A result is OK, WARN, FAIL or INCOMPLETE. A check that was skipped, timed out or crashed is
INCOMPLETE, never OK. Exit codes fit Slurm's HealthCheckProgram and Kubernetes node-problem-detector
custom plugins: 0 = OK (WARN included), 1 = a problem (any FAIL), 3 = unknown (no FAIL, but at least
one INCOMPLETE).
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any

from gpufleet.core.exitcodes import ExitCode

__all__ = ["SCHEMA", "Status", "CheckResult", "Report"]

SCHEMA = "gpufleet.health/1"


class Status(enum.StrEnum):
    OK = "OK"
    WARN = "WARN"
    FAIL = "FAIL"
    INCOMPLETE = "INCOMPLETE"


_RANK = {Status.OK: 0, Status.WARN: 1, Status.INCOMPLETE: 2, Status.FAIL: 3}


@dataclass
class CheckResult:
    """One check's verdict. ``value``/``threshold`` are in ``unit``; ``device`` is set per device."""

    check: str
    status: Status
    value: float | None = None
    unit: str = ""
    threshold: float | None = None
    detail: str = ""
    hint: str = ""
    duration_s: float = 0.0
    component: str = "unknown"
    device: str | None = None
    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["status"] = str(self.status)
        return d


def worst(statuses: list[Status]) -> Status:
    return max(statuses, key=lambda s: _RANK[s]) if statuses else Status.INCOMPLETE


@dataclass
class Report:
    """The results of one plan run on one node."""

    node: str
    plan: str
    profile: str
    started: float
    duration_s: float
    results: list[CheckResult]
    valid_until: float
    not_applicable: list[str] = field(default_factory=list)

    @property
    def status(self) -> Status:
        return worst([r.status for r in self.results]) if self.results else Status.OK

    def exit_code(self) -> int:
        st = {r.status for r in self.results}
        if Status.FAIL in st:
            return ExitCode.CHECK_PROBLEM
        if Status.INCOMPLETE in st:
            return ExitCode.CHECK_UNKNOWN
        return ExitCode.OK

    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if r.status is Status.FAIL]

    def to_dict(self) -> dict[str, Any]:
        counts = {str(s): sum(1 for r in self.results if r.status is s) for s in Status}
        return {
            "schema": SCHEMA,
            "node": self.node,
            "plan": self.plan,
            "profile": self.profile,
            "started": self.started,
            "duration_s": round(self.duration_s, 3),
            "valid_until": self.valid_until,
            "status": str(self.status),
            "exit_code": self.exit_code(),
            "counts": counts,
            "not_applicable": self.not_applicable,
            "results": [r.to_dict() for r in self.results],
        }

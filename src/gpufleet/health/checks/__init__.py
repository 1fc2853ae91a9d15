"""The check registry. Each module registers its checks; none imports torch or NVML at import time.

A check is ``fn(ctx) -> list[CheckResult]``. The runner gives it a thread and a timeout; a check that
starts subprocesses passes ``ctx.remaining()`` as their timeout.
"""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpufleet.health.profiles import Profile
from gpufleet.health.results import CheckResult, Status

__all__ = ["Context", "CheckSpec", "NotApplicable", "register", "registry", "result", "measured", "FAMILIES"]

FAMILIES = ("host", "gpu", "links", "compute", "memory", "collective", "storage", "dcgm")


class NotApplicable(Exception):
    """Raised by a check whose subject is absent on this node (no NVMe drive, DCGM not installed): the
    report lists it as not applicable, with this message, instead of a result."""


@dataclass
class Context:
    """What a check sees: the node, its profile, the plan's parameters for it and its deadline."""

    node: str
    profile: Profile
    params: dict[str, Any]
    deadline: float
    expect_gpus: int
    scratch: Path
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))

    def remaining(self, floor: float = 1.0) -> float:
        return max(floor, self.deadline - time.monotonic())

    def param(self, key: str, default: Any) -> Any:
        return self.params.get(key, default)

    @property
    def gpu(self) -> bool:
        return self.profile.gpus > 0


CheckFn = Callable[[Context], list[CheckResult]]


@dataclass(frozen=True)
class CheckSpec:
    name: str
    fn: CheckFn
    component: str
    requires_gpu: bool
    default_timeout_s: float
    summary: str


_REGISTRY: dict[str, CheckSpec] = {}


def register(
    name: str, *, component: str, timeout_s: float, requires_gpu: bool = False
) -> Callable[[CheckFn], CheckFn]:
    def deco(fn: CheckFn) -> CheckFn:
        doc = (fn.__doc__ or "").strip().splitlines()
        _REGISTRY[name] = CheckSpec(name, fn, component, requires_gpu, timeout_s, doc[0] if doc else "")
        return fn

    return deco


def registry() -> dict[str, CheckSpec]:
    """All checks, by name (imports every check module; they are light)."""
    for fam in FAMILIES:
        importlib.import_module(f"gpufleet.health.checks.{fam}")
    return dict(sorted(_REGISTRY.items()))


def result(check: str, status: Status, detail: str = "", **kw: Any) -> CheckResult:
    return CheckResult(check=check, status=status, detail=detail, **kw)


def measured(
    ctx: Context, check: str, metric: str, si_value: float, *, hint: str = "", detail: str = "", **kw: Any
) -> CheckResult:
    """Judge an SI measurement against the profile's threshold for ``metric``."""
    th = ctx.profile.threshold(metric)
    if th is None:
        return CheckResult(
            check, Status.OK, si_value, "SI", None, detail or f"no threshold for {metric} in profile", **kw
        )
    value = th.scale(si_value)
    status, limit = th.judge(value)
    return CheckResult(
        check=check,
        status=status,
        value=round(value, 6),
        unit=th.unit,
        threshold=limit,
        detail=detail,
        hint=hint if status is not Status.OK else "",
        **kw,
    )

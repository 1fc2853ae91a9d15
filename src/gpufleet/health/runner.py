"""Runs a plan on this node: each check in a thread with a timeout, then records results in the fleet ledger.

A check that raises is INCOMPLETE with the reason and the plan goes on. A check that overruns its
timeout is INCOMPLETE; its thread is abandoned (a daemon) and any subprocess it started has its own
timeout. Checks not started before the plan's budget ran out are INCOMPLETE too.
After the node-peer rule (inside the checks), results with a value are compared with the newest valid
results of the same check from other nodes of the same profile in the fleet ledger (the fleet-peer rule).
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from gpufleet.core import events as E
from gpufleet.core.launch import node_name
from gpufleet.core.ledger import Ledger, read_events
from gpufleet.health.checks import CheckSpec, Context, NotApplicable, registry
from gpufleet.health.nodes import fleet_dir
from gpufleet.health.plans import Plan
from gpufleet.health.profiles import Profile
from gpufleet.health.relative import fleet_outlier
from gpufleet.health.results import CheckResult, Report, Status

__all__ = ["run_plan", "record_report", "fleet_peers", "apply_fleet_rule"]


# Throughput checks compared with fleet peers; counts and free space are not.
FLEET_RULE_CHECKS = frozenset(
    {
        "compute.matmul",
        "memory.bandwidth",
        "memory.h2d",
        "collective.allreduce",
        "storage.throughput",
        "storage.checkpoint",
    }
)


# Threads of checks that timed out: nothing can stop them, and they may still be inside native code.
_ABANDONED: list[threading.Thread] = []


def exit_past_hung_checks(code: int) -> None:
    """Exit with ``code`` at once when a timed-out check's thread still runs: interpreter shutdown
    under a thread inside native code (a torch matmul, a driver call) aborts the process
    (``std::terminate``), which would lose the exit code. Returns when no such thread is left."""
    if any(t.is_alive() for t in _ABANDONED):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _run_one(
    spec: CheckSpec, ctx: Context, timeout: float, box: dict[str, Any] | None = None
) -> list[CheckResult]:
    """The check's results; none when it raised :class:`NotApplicable` (its message in ``box["na"]``)."""
    box = {} if box is None else box

    def target() -> None:
        try:
            box["out"] = spec.fn(ctx)
        except NotApplicable as e:
            box["na"] = str(e)
        except Exception as e:  # noqa: BLE001 - a crashing check must become INCOMPLETE, not stop the plan
            box["err"] = f"{type(e).__name__}: {e}"

    t0 = time.monotonic()
    th = threading.Thread(target=target, name=f"check-{spec.name}", daemon=True)
    th.start()
    th.join(timeout)
    dur = time.monotonic() - t0
    if th.is_alive():
        _ABANDONED.append(th)
        out = [
            CheckResult(
                spec.name,
                Status.INCOMPLETE,
                detail=f"timed out after {timeout:.0f} s",
                hint="the check hung: look for a stuck device, filesystem or driver call",
            )
        ]
    elif "na" in box:
        return []
    elif "err" in box:
        out = [CheckResult(spec.name, Status.INCOMPLETE, detail=f"check crashed: {box['err']}"[:300])]
    else:
        out = list(box.get("out") or [])
        if not out:
            out = [CheckResult(spec.name, Status.INCOMPLETE, detail="check returned no result")]
    for r in out:
        r.duration_s = round(dur, 3)
        if r.component == "unknown":
            r.component = spec.component
    return out


def run_plan(
    plan: Plan,
    profile: Profile,
    *,
    node: str | None = None,
    expect_gpus: int | None = None,
    scratch: Path | None = None,
    env: dict[str, str] | None = None,
) -> Report:
    """Run every check of ``plan`` against ``profile`` and return the report (nothing recorded)."""
    specs = registry()
    node = node or node_name()
    started, t0 = time.time(), time.monotonic()
    budget_end = t0 + plan.budget_s
    results: list[CheckResult] = []
    not_applicable: list[str] = []
    scratch = scratch or Path(tempfile.gettempdir())
    for pc in plan.checks:
        spec = specs[pc.name]
        if spec.requires_gpu and profile.gpus == 0:
            not_applicable.append(pc.name)
            continue
        left = budget_end - time.monotonic()
        if left <= 0:
            results.append(
                CheckResult(
                    pc.name,
                    Status.INCOMPLETE,
                    component=spec.component,
                    detail=f"not run: plan budget of {plan.budget_s:g} s exhausted",
                )
            )
            continue
        timeout = min(pc.timeout_s or spec.default_timeout_s, max(1.0, left))
        ctx = Context(
            node=node,
            profile=profile,
            params=dict(pc.params),
            deadline=time.monotonic() + timeout,
            expect_gpus=profile.gpus if expect_gpus is None else expect_gpus,
            scratch=scratch,
            env=dict(os.environ if env is None else env),
        )
        box: dict[str, Any] = {}
        results.extend(_run_one(spec, ctx, timeout, box))
        if "na" in box:
            not_applicable.append(f"{pc.name} ({box['na']})")
    dur = time.monotonic() - t0
    return Report(
        node=node,
        plan=plan.name,
        profile=profile.name,
        started=started,
        duration_s=dur,
        results=results,
        valid_until=started + dur + plan.valid_s,
        not_applicable=not_applicable,
    )


def fleet_peers(
    events: list[dict[str, Any]], node: str, profile: str, now: float
) -> dict[tuple[str, str], list[float]]:
    """Newest valid value per (check, device) from every *other* node of ``profile``."""
    latest: dict[tuple[str, str, str], tuple[float, float]] = {}
    for e in events:
        if e.get("ev") != E.HealthResult.kind or e.get("node") == node or e.get("profile") != profile:
            continue
        if e.get("value") is None or float(e.get("valid_until", 0)) < now or e.get("status") == "INCOMPLETE":
            continue
        key = (str(e.get("check")), str(e.get("device")), str(e["node"]))
        t = float(e.get("t", 0))
        if key not in latest or latest[key][0] <= t:
            latest[key] = (t, float(e["value"]))
    out: dict[tuple[str, str], list[float]] = {}
    for (check, device, _n), (_t, v) in latest.items():
        out.setdefault((check, device), []).append(v)
    return out


def apply_fleet_rule(report: Report, profile: Profile, peers: dict[tuple[str, str], list[float]]) -> None:
    """Mark results more than k MADs below their fleet peers (same check and device slot) as FAIL."""
    for r in report.results:
        if r.value is None or r.status is Status.INCOMPLETE or r.check not in FLEET_RULE_CHECKS:
            continue
        th = profile.threshold(metric_of(r))
        if th is None or th.fail_below is None:  # only "higher is better" metrics have a fleet rule
            continue
        vals = peers.get((r.check, str(r.device)), [])
        bad, cut = fleet_outlier(r.value, vals, profile.mad_k, profile.mad_min_drop, profile.fleet_min_peers)
        r.data["fleet_peers"] = len(vals)
        if bad and cut is not None:
            r.status = Status.FAIL
            r.detail = (
                f"below its {len(vals)} fleet peers (cut-off {cut:.4g} {r.unit}, {profile.mad_k:g} MADs)"
            )
            r.data["relative"] = "fleet"


def metric_of(r: CheckResult) -> str:
    dev = str(r.device or "")
    """The profile metric a result was judged by ("" when none)."""
    if r.check == "host.resources":
        return {"cpus": "host.cpus", "mem": "host.mem"}.get(dev, "host.free_disk")
    if r.check == "host.clock":
        return "host.clock_offset"
    if r.check == "storage.throughput":
        return "storage." + dev.rsplit(":", 1)[-1]
    if r.check == "memory.h2d":
        return "memory.d2h" if dev.endswith(":d2h") else "memory.h2d"
    return {
        "compute.matmul": "compute.matmul",
        "memory.bandwidth": "memory.copy",
        "collective.allreduce": "collective.busbw",
        "storage.checkpoint": "storage.checkpoint",
    }.get(r.check, "")


def record_report(report: Report, fleet: str | os.PathLike[str] | None = None) -> Path:
    """Append one ``health_result`` event per result to the fleet ledger."""
    d = fleet_dir(fleet)
    with Ledger(d) as ledger:
        for r in report.results:
            ledger.emit(
                E.HealthResult(
                    node=report.node,
                    plan=report.plan,
                    profile=report.profile,
                    valid_until=report.valid_until,
                    **{k: v for k, v in r.to_dict().items() if k != "data"},
                )
            )
    return d


def load_fleet_events(fleet: str | os.PathLike[str] | None = None) -> list[dict[str, Any]]:
    return read_events(fleet_dir(fleet))

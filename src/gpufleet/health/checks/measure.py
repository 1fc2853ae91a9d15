"""Shared measurement helpers: timed loops, per-device judging with the node-peer rule, slowdown injection.

Slowdown injection (for the detection benchmark and tests) happens at the process boundary:
``GPUFLEET_HEALTH_INJECT_SLOW="compute.matmul:cpu1=0.2,memory.bandwidth:gpu3=0.2"`` makes the named
device's timed region that much slower (throughput x (1 - 0.2)) by sleeping inside it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from gpufleet.core.env import Env
from gpufleet.health.checks import Context, measured
from gpufleet.health.relative import node_outliers
from gpufleet.health.results import CheckResult, Status

INJECT_ENV = Env.HEALTH_INJECT_SLOW


def injected_slowdown(check: str, device: str, env: Mapping[str, str] | None = None) -> float:
    spec = INJECT_ENV.get(env)
    for item in spec.split(","):
        key, _, frac = item.strip().partition("=")
        if key == f"{check}:{device}" and frac:
            return min(0.95, max(0.0, float(frac)))
    return 0.0


def timed(work: Callable[[], None], sync: Callable[[], None], iters: int, slowdown: float) -> float:
    """Seconds for ``iters`` calls of ``work`` (synchronised), stretched by an injected slowdown."""
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        work()
    sync()
    dt = time.perf_counter() - t0
    if slowdown > 0:
        stretch(t0 + dt / (1.0 - slowdown))
    return time.perf_counter() - t0


def stretch(until: float) -> None:
    """Wait until ``perf_counter() >= until``: sleep most of it, spin the last 2 ms (sleep overshoots)."""
    left = until - time.perf_counter()
    if left > 0.004:
        time.sleep(left - 0.002)
    while time.perf_counter() < until:
        pass


def min_of_samples(
    lanes: list[str], work: Callable[[str], None], samples: int, slowdowns: Mapping[str, float]
) -> dict[str, float]:
    """Shortest time of one ``work(lane)`` call per lane over ``samples`` round-robin rounds.

    Many tiny interleaved samples and the minimum make this robust on a busy, shared machine: a sample
    that ran without being preempted exists for every lane, and drift hits every lane alike.
    """
    best = {lane: float("inf") for lane in lanes}
    for _ in range(samples):
        for lane in lanes:
            t0 = time.perf_counter()
            work(lane)
            dt = time.perf_counter() - t0
            s = slowdowns.get(lane, 0.0)
            if s > 0:
                stretch(t0 + dt / (1.0 - s))
                dt = time.perf_counter() - t0
            best[lane] = min(best[lane], dt)
    return best


def calibrate(work: Callable[[], None], sync: Callable[[], None], target_s: float) -> int:
    """Iterations of ``work`` that take about ``target_s`` (after one warm-up call)."""
    work()
    sync()
    t0 = time.perf_counter()
    work()
    sync()
    one = max(time.perf_counter() - t0, 1e-6)
    return max(1, int(target_s / one))


def per_device(
    ctx: Context, check: str, metric: str, values: dict[str, float], hint: str, relative: bool = True
) -> list[CheckResult]:
    """Judge each device's SI value against the profile's floor and against its node peers.

    A plan can turn the peer rule off for one check (``peer_rule = false``): on a shared CPU host
    one core can run a third slower than the other for minutes, which says nothing about the node."""
    out = [measured(ctx, check, metric, v, hint=hint, device=d) for d, v in values.items()]
    relative = relative and bool(ctx.param("peer_rule", True))
    slow = node_outliers(values, ctx.profile.peer_tol) if relative else {}
    for r in out:
        if r.device in slow:
            r.status = Status.FAIL
            r.detail = (
                f"{slow[r.device]:.0%} below the best device on this node "
                f"(peer tolerance {ctx.profile.peer_tol:.0%})"
            )
            r.hint = hint
            r.data["relative"] = "node"
        elif not r.detail:
            r.detail = "ok" if r.status is Status.OK else "below the profile's floor"
    return out

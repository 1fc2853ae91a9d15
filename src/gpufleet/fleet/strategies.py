"""Recovery strategies: checkpoint method, tier, restart kind, spares and lemon exclusion.

A :class:`Strategy` holds resolved times in seconds. :func:`strategies` derives the four methods from a
profile's checkpoint bytes and bandwidths (or from a run's measurements, see ``calibrate``) and the
ratios this project measured between them (docs/benchmarks.md, P1 and P2):

* ``sync``: torch.save-like; training waits for the copy off the GPU and the whole write.
* ``dcp-async``: DCP ``async_save``; training waits for its staging copy, the write runs behind.
* ``gpufleet-async``: gpufleet's deferred copy overlaps the next step; P1 measured its stall at
  0.014x DCP's blocking part (0.018 s vs 1.31 s for 2 GB); P2 measured persist 1.43x and restore
  1.55x DCP's throughput.
* ``peer-inproc``: gpufleet's snapshot replicated to a peer node's memory; a failure that the peer
  copy survives loads from there; ranks restart in process unless the job must be requeued.

Each comes plain and ``+spares`` (hot spares, lemon exclusion after 3 failures, acceptance screening).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpufleet.fleet.calibrate import Calibration
    from gpufleet.fleet.profiles import Profile

__all__ = [
    "Strategy",
    "METHODS",
    "P1_GPUFLEET_OVER_DCP_STALL",
    "P2_DCP_PERSIST_SLOWDOWN",
    "P2_DCP_RESTORE_SLOWDOWN",
    "LEMON_K",
    "SCREENING",
    "default_spares",
    "strategies",
    "strategy",
]

P1_GPUFLEET_OVER_DCP_STALL = 0.018 / 1.31
"""P1 (docs/benchmarks.md): gpufleet's median stall 0.018 s vs DCP async_save's blocking 1.31 s (2 GB)."""
P2_DCP_PERSIST_SLOWDOWN = 2.41 / 1.68
"""P2: gpufleet persists at 2.41 GB/s, DCP at 1.68 GB/s."""
P2_DCP_RESTORE_SLOWDOWN = 1.55
"""P2: gpufleet restores 1.55x faster than DCP."""
LEMON_K = 3
"""Lemon exclusion after this many failures (the default of ``gpufleet nodes``: 3 in 30 days)."""
SCREENING = 0.9
"""ASSUMED share of early-life failures an acceptance test catches before a node joins."""

METHODS = ("sync", "dcp-async", "gpufleet-async", "peer-inproc")


@dataclass(kw_only=True, slots=True, frozen=True)
class Strategy:
    name: str
    """Method name, with ``+spares`` for the variant with spares and lemon exclusion."""
    stall_s: float
    """Training time blocked per checkpoint (δ)."""
    persist_s: float = 0.0
    """Background write after the stall; a failure before it ends falls back to the previous one."""
    load_s: float
    """Load from the persistent tier after a restart."""
    interval_s: float | None = None
    """Work between checkpoints; None: Young/Daly ``auto`` (raised to 1.25x persist)."""
    min_interval_s: float = 0.0
    """A checkpoint interval is at least this (a training step)."""
    peer_memory: bool = False
    """Snapshots are replicated to a peer's memory; recoverable failures load from there."""
    peer_load_s: float = 0.0
    in_process: bool = False
    """Ranks restart in process (no relaunch) unless the job must be requeued for a node."""
    hot_spares: int = 0
    """Spare nodes held ready; a replaced node returns to the pool after the profile's repair time."""
    lemon_k: int = 0
    """Exclude a node after this many failures (0: never)."""
    screening: float = 0.0
    """Share of early-life failures caught by acceptance tests before a node joins."""

    @property
    def method(self) -> str:
        return self.name.split("+", 1)[0]


def default_spares(gpus: int, gpus_per_node: int) -> int:
    """Hot spares for the ``+spares`` variants: 1% of the job's nodes, at least 2."""
    return max(2, math.ceil(0.01 * gpus / gpus_per_node))


def _methods(profile: Profile, cal: Calibration | None) -> dict[str, Strategy]:
    io = profile.checkpoint
    b = io.bytes_per_gpu / 1e9
    copy = b / io.host_copy_gbps
    write = b / io.write_gbps_per_gpu
    load = b / io.read_gbps_per_gpu
    stall_g = copy * P1_GPUFLEET_OVER_DCP_STALL
    peer_load = b / io.peer_gbps
    step = 0.0
    if cal is not None:  # measured by gpufleet in the run: its stall, persist, load and step
        step = cal.step_s
        if cal.load_s is not None:
            peer_load *= cal.load_s / load
            load = cal.load_s
        if cal.has_checkpoints:
            stall_g, write = cal.stall_s, cal.persist_s
            copy = stall_g / P1_GPUFLEET_OVER_DCP_STALL
    return {
        "sync": Strategy(name="sync", stall_s=copy + write, load_s=load, min_interval_s=step),
        "dcp-async": Strategy(
            name="dcp-async",
            stall_s=copy,
            persist_s=write * P2_DCP_PERSIST_SLOWDOWN,
            load_s=load * P2_DCP_RESTORE_SLOWDOWN,
            min_interval_s=step,
        ),
        "gpufleet-async": Strategy(
            name="gpufleet-async", stall_s=stall_g, persist_s=write, load_s=load, min_interval_s=step
        ),
        "peer-inproc": Strategy(
            name="peer-inproc",
            stall_s=stall_g,
            persist_s=write,
            load_s=load,
            peer_memory=True,
            peer_load_s=peer_load,
            in_process=True,
            min_interval_s=step,
        ),
    }


def strategies(
    profile: Profile,
    gpus: int,
    *,
    cal: Calibration | None = None,
    spares: int | None = None,
    interval_s: float | None = None,
) -> list[Strategy]:
    """The table's eight strategies: each method plain and ``+spares`` (spares, lemons out, screening)."""
    n_spares = default_spares(gpus, profile.gpus_per_node) if spares is None else spares
    out: list[Strategy] = []
    for s in _methods(profile, cal).values():
        s = replace(s, interval_s=interval_s)
        out.append(s)
        out.append(
            replace(s, name=f"{s.name}+spares", hot_spares=n_spares, lemon_k=LEMON_K, screening=SCREENING)
        )
    return out


def strategy(profile: Profile, name: str, gpus: int, **kw: object) -> Strategy:
    """One strategy of :func:`strategies` by name (``sync``, ``peer-inproc+spares``, ...)."""
    from gpufleet.core.errors import ConfigError

    table = {s.name: s for s in strategies(profile, gpus, **kw)}  # type: ignore[arg-type]
    if name not in table:
        raise ConfigError(f"unknown strategy {name!r}; valid: {', '.join(table)}")
    return table[name]

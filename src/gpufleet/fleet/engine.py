"""The Monte Carlo engine: vectorized numpy over replicates, one pass over the event index.

Why numpy and not SimPy: the job is one synchronous state machine, and between two interruptions its
progress has a closed form (checkpoint cycles of ``interval + stall``), so there is no event queue to
keep. Every replicate's interruptions are drawn up front as padded ``(replicates, events)`` arrays,
sorted, and the recovery of each is resolved in one loop over the event index that updates all
replicates at once. 100K GPUs x 90 days x 1,000 replicates is ~4,400 events per replicate: the
loop runs ~4,400 numpy steps on arrays of 1,000 (benchmarks/bench_fleet_sim.py). A SimPy process per
replicate would schedule the same 4.4M events one Python generator step at a time
(``benchmarks/bench_fleet_sim.py --simpy`` measures its event rate when SimPy is installed).

The model (docs/fleet-sim.md has it in full):

* Interruptions arrive as Poisson processes in wall time: each cause at its rate for this job's
  size, planned interruptions at the profile's job-level rate, lemon nodes at ``multiplier - 1``
  times the base hardware rate on top (capped at K failures per lemon with exclusion), and each node
  replacement brings an early-life failure with probability ``p x (1 - screening)``.
* A failure during a recovery restarts the recovery (Daly's model), so recoveries can chain.
* Recovery = detect + (spare swap | requeue) + (restart | in-process restart) + load (disk or peer).
  Planned interruptions save first (stall + persist) and lose no work.
* Between interruptions the job computes in cycles: ``interval`` of work, then the ``stall``. A
  checkpoint is durable ``persist`` after its stall ends; a failure loses the work since the last
  durable checkpoint of the tier it recovers from (peer memory when the strategy has it and the
  failure leaves the peer copy intact, else the persistent tier, written every k-th snapshot).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from gpufleet.reliability.interval import daly

if TYPE_CHECKING:
    from gpufleet.fleet.profiles import Profile
    from gpufleet.fleet.strategies import Strategy

__all__ = ["Scenario", "Result", "simulate", "BADPUT", "SRC_BASE", "SRC_LEMON", "SRC_EARLY", "SRC_PLANNED"]

BADPUT = ("ckpt_stall", "recompute", "detect", "replace", "restart", "load", "planned")
SRC_BASE, SRC_LEMON, SRC_EARLY, SRC_PLANNED = 0, 1, 2, 3
PERSIST_MARGIN = 1.25  # as IntervalPolicy: a save must have persisted before the next one is due


@dataclass(kw_only=True, slots=True)
class Scenario:
    """A job on a fleet, fully resolved: rates per second for this job's size, times in seconds."""

    gpus: int
    """GPUs in the job."""
    gpus_per_node: int = 8
    horizon_s: float
    """Wall time simulated."""
    cause_names: tuple[str, ...]
    cause_rates: tuple[float, ...]
    """Failures per second of each cause, for this job."""
    cause_replace: tuple[bool, ...]
    cause_peer: tuple[bool, ...]
    planned_rate: float = 0.0
    hw_node_rate: float = 0.0
    """Per-node rate of node-replacing causes (lemons multiply it)."""
    lemon_fraction: float = 0.0
    lemon_multiplier: float = 1.0
    early_prob: float = 0.0
    early_window_s: float = 72 * 3600.0
    detect_s: float = 0.0
    spare_swap_s: float = 0.0
    requeue_s: float = 0.0
    restart_s: float = 0.0
    inproc_restart_s: float = 0.0
    repair_s: float = 72 * 3600.0
    min_interval_s: float = 0.0
    """Profile floor on the checkpoint interval (storage cost and interference)."""
    strategy: Strategy

    @property
    def nodes(self) -> int:
        return math.ceil(self.gpus / self.gpus_per_node)

    @classmethod
    def build(cls, profile: Profile, gpus: int, days: float, strategy: Strategy) -> Scenario:
        nodes = math.ceil(gpus / profile.gpus_per_node)
        rec = profile.recovery
        return cls(
            gpus=gpus,
            gpus_per_node=profile.gpus_per_node,
            horizon_s=days * 86400.0,
            cause_names=tuple(c.name for c in profile.cause),
            cause_rates=tuple(profile.cause_rate(c, nodes) for c in profile.cause),
            cause_replace=tuple(c.replace for c in profile.cause),
            cause_peer=tuple(c.peer_survives for c in profile.cause),
            planned_rate=profile.planned_rate(),
            hw_node_rate=profile.hardware_node_rate(),
            lemon_fraction=profile.lemon.fraction,
            lemon_multiplier=profile.lemon.multiplier,
            early_prob=profile.early_life.probability,
            early_window_s=profile.early_life.window_h * 3600.0,
            detect_s=rec.detect_s,
            spare_swap_s=rec.spare_swap_s,
            requeue_s=rec.requeue_s,
            restart_s=rec.restart_s,
            inproc_restart_s=rec.inproc_restart_s,
            repair_s=rec.repair_h * 3600.0,
            min_interval_s=profile.checkpoint.min_interval_s,
            strategy=strategy,
        )

    # -- expected rates (for the auto interval) ---------------------------------------------------

    def lemon_rate(self) -> float:
        """Expected extra failures per second from lemons (capped at K each with exclusion)."""
        if self.lemon_fraction <= 0.0 or self.lemon_multiplier <= 1.0:
            return 0.0
        per = (self.lemon_multiplier - 1.0) * self.hw_node_rate
        k = self.strategy.lemon_k
        n = per * self.horizon_s if k <= 0 else min(per * self.horizon_s, float(k))
        return self.nodes * self.lemon_fraction * n / self.horizon_s

    def failure_rate(self) -> float:
        """Expected unplanned failures per second (base + lemons + early-life)."""
        base = sum(self.cause_rates)
        rep = sum(r for r, x in zip(self.cause_rates, self.cause_replace, strict=True) if x)
        lem = self.lemon_rate()
        early = self.early_prob * (1.0 - self.strategy.screening) * (rep + lem)
        return base + lem + early

    def intervals(self) -> tuple[float, int]:
        """(work between snapshots, every k-th snapshot goes to the persistent tier)."""
        s = self.strategy
        rate = self.failure_rate()
        m = 1.0 / rate if rate > 0 else math.inf
        floor = max(s.min_interval_s, self.min_interval_s, 1e-3)
        if s.interval_s is not None:
            tau = max(s.interval_s, 1e-3)
        elif math.isinf(m):
            tau = self.horizon_s
        else:
            tau = max(daly(s.stall_s, m), floor)
        if s.peer_memory:
            tau = max(tau, PERSIST_MARGIN * s.peer_load_s)
            k = max(1, math.ceil(PERSIST_MARGIN * s.persist_s / (tau + s.stall_s)))
        else:
            tau = max(tau, PERSIST_MARGIN * s.persist_s)
            k = 1
        return tau, k


@dataclass(kw_only=True, slots=True)
class Result:
    """Per-replicate arrays of one simulation (seconds, counts)."""

    scenario: Scenario
    interval_s: float
    disk_every: int
    productive: np.ndarray
    badput: dict[str, np.ndarray]
    failures: np.ndarray
    planned: np.ndarray
    by_cause: np.ndarray
    """(replicates, causes) failure counts."""
    by_source: dict[str, np.ndarray]
    hw_failures: np.ndarray
    """Failures of node-replacing causes that hit healthy nodes (the paper's r_f events)."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ettr(self) -> np.ndarray:
        return self.productive / self.scenario.horizon_s


def _poisson_times(rng: np.random.Generator, lam: np.ndarray, horizon: float) -> np.ndarray:
    """(R, K) arrival times of Poisson processes with mean counts ``lam`` per row; inf pads."""
    counts = rng.poisson(lam)
    k = int(counts.max(initial=0))
    t = rng.random((lam.shape[0], k)) * horizon
    t[np.arange(k)[None, :] >= counts[:, None]] = np.inf
    return t


def _events(sc: Scenario, seed: int, reps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Sorted interruption times (R, K; inf pads), cause codes (planned = len(causes)), sources,
    and the number of lemon nodes in each replicate's job."""
    h = sc.horizon_s
    s = sc.strategy
    g_base, g_lemon, g_early, g_planned = (
        np.random.default_rng(x) for x in np.random.SeedSequence(seed).spawn(4)
    )
    rates = np.asarray(sc.cause_rates, dtype=float)
    n_c = len(rates)
    total = float(rates.sum())
    parts_t, parts_c, parts_s = [], [], []
    n_lemons = np.zeros(reps, np.int64)
    t = _poisson_times(g_base, np.full(reps, total * h), h)
    parts_t.append(t)
    c = g_base.choice(n_c, size=t.shape, p=rates / total) if total > 0 else np.zeros(t.shape, int)
    parts_c.append(c)
    parts_s.append(np.full(t.shape, SRC_BASE, np.int8))

    replace = np.asarray(sc.cause_replace, dtype=bool)
    hw_p = rates * replace
    hw_p = hw_p / hw_p.sum() if hw_p.sum() > 0 else None

    if sc.lemon_fraction > 0 and sc.lemon_multiplier > 1 and sc.hw_node_rate > 0 and hw_p is not None:
        n_lemons = g_lemon.binomial(sc.nodes, sc.lemon_fraction, size=reps)
        lmax = int(n_lemons.max(initial=0))
        per = (sc.lemon_multiplier - 1.0) * sc.hw_node_rate * h
        counts = g_lemon.poisson(per, size=(reps, lmax))
        counts[np.arange(lmax)[None, :] >= n_lemons[:, None]] = 0
        nmax = int(counts.max(initial=0))
        lt = g_lemon.random((reps, lmax, nmax)) * h
        lt[np.arange(nmax)[None, None, :] >= counts[:, :, None]] = np.inf
        lt.sort(axis=2)
        if s.lemon_k > 0:
            lt = lt[:, :, : s.lemon_k]
        lt = lt.reshape(reps, -1)
        parts_t.append(lt)
        parts_c.append(g_lemon.choice(n_c, size=lt.shape, p=hw_p))
        parts_s.append(np.full(lt.shape, SRC_LEMON, np.int8))

    if sc.early_prob > 0 and hw_p is not None:
        tt = np.concatenate(parts_t, axis=1)
        cc = np.concatenate(parts_c, axis=1)
        u = g_early.random(tt.shape)
        dt = g_early.exponential(sc.early_window_s, tt.shape)
        spawn = np.isfinite(tt) & replace[cc] & (u < sc.early_prob * (1.0 - s.screening))
        et = np.where(spawn, tt + dt, np.inf)
        parts_t.append(et)
        parts_c.append(g_early.choice(n_c, size=et.shape, p=hw_p))
        parts_s.append(np.full(et.shape, SRC_EARLY, np.int8))

    if sc.planned_rate > 0:
        pt = _poisson_times(g_planned, np.full(reps, sc.planned_rate * h), h)
        parts_t.append(pt)
        parts_c.append(np.full(pt.shape, n_c))
        parts_s.append(np.full(pt.shape, SRC_PLANNED, np.int8))

    tt = np.concatenate(parts_t, axis=1)
    cc = np.concatenate(parts_c, axis=1)
    ss = np.concatenate(parts_s, axis=1)
    tt[tt >= h] = np.inf
    order = np.argsort(tt, axis=1, kind="stable")
    tt = np.take_along_axis(tt, order, axis=1)
    cc = np.take_along_axis(cc, order, axis=1)
    ss = np.take_along_axis(ss, order, axis=1)
    k = int(np.isfinite(tt).sum(axis=1).max(initial=0))
    return tt[:, :k], cc[:, :k], ss[:, :k], n_lemons


def _spare_ok(tt: np.ndarray, is_rep: np.ndarray, spares: int, repair_s: float, horizon: float) -> np.ndarray:
    """Per event: was a hot spare free? (replacements within the repair time before it < spares)."""
    reps, k = tt.shape
    if spares <= 0 or k == 0:
        return np.zeros(tt.shape, bool)
    big = 4.0 * (horizon + repair_s)
    fin = np.where(np.isfinite(tt), tt, 2.0 * horizon + repair_s)
    off = (np.arange(reps) * big)[:, None]
    flat = (fin + off).ravel()
    j0 = np.searchsorted(flat, (fin - repair_s + off).ravel(), side="right").reshape(reps, k)
    j0 -= (np.arange(reps) * k)[:, None]
    cum = np.concatenate([np.zeros((reps, 1), np.int64), np.cumsum(is_rep, axis=1)], axis=1)
    before = cum[:, :-1]  # replacements with index < i
    in_repair = before - np.take_along_axis(cum, j0, axis=1)
    return in_repair < spares


def simulate(sc: Scenario, replicates: int = 1000, seed: int = 0) -> Result:
    """Run ``replicates`` Monte Carlo replicates of the scenario (deterministic for a seed)."""
    s = sc.strategy
    h = sc.horizon_s
    tt, cc, ss, n_lemons = _events(sc, seed, replicates)
    reps, k = tt.shape
    n_c = len(sc.cause_rates)
    planned = (cc == n_c) & np.isfinite(tt)
    fail = np.isfinite(tt) & ~planned
    replace_c = np.append(np.asarray(sc.cause_replace, bool), False)
    peer_c = np.append(np.asarray(sc.cause_peer, bool), True)
    is_rep = fail & replace_c[cc]
    spare = _spare_ok(tt, is_rep, s.hot_spares, sc.repair_s, h)
    requeue = is_rep & ~spare

    inproc_ok = fail & s.in_process & ~requeue
    from_peer = fail & s.peer_memory & peer_c[cc]

    tau, kd = sc.intervals()
    delta, persist = s.stall_s, s.persist_s
    cyc = tau + delta
    mem_p = s.peer_load_s if s.peer_memory else 0.0

    work_acc = np.zeros(reps)
    stall_acc = np.zeros(reps)
    lost_acc = np.zeros(reps)
    ph_acc = np.zeros((5, reps))
    t_prev = np.zeros(reps)
    r_prev = np.zeros(reps)
    p_prev = np.zeros((5, reps))
    cur = np.zeros((5, reps))
    w0 = np.zeros(reps)  # work since the last durable persistent-tier checkpoint
    s0 = np.zeros(reps)  # snapshots since then
    for i in range(k + 1):
        if i < k:
            col = tt[:, i]
            ti = np.where(np.isfinite(col), col, t_prev)
        else:
            ti = np.full(reps, h)
        g = np.maximum(ti - t_prev, 0.0)
        spent = np.minimum(g, r_prev)
        with np.errstate(invalid="ignore", divide="ignore"):
            frac = np.where(r_prev > 0, spent / r_prev, 0.0)
        ph_acc += p_prev * frac
        up = g - spent
        n = np.floor(up / cyc)
        rem = up - n * cyc
        work = n * tau + np.minimum(rem, tau)
        work_acc += work
        stall_acc += n * delta + np.maximum(rem - tau, 0.0)
        if i == k:
            break
        f_i = fail[:, i]
        pl_i = planned[:, i]
        rep_i = is_rep[:, i]
        cur[0] = np.where(f_i, sc.detect_s, 0.0)
        cur[1] = np.where(rep_i, np.where(spare[:, i], sc.spare_swap_s, sc.requeue_s), 0.0)
        cur[2] = np.where(inproc_ok[:, i], sc.inproc_restart_s, sc.restart_s)
        cur[3] = np.where(from_peer[:, i], s.peer_load_s, s.load_s)
        cur[4] = np.where(pl_i, s.stall_s + s.persist_s, 0.0)
        # Persistent tier: snapshots whose persist finished before the failure; every kd-th is written.
        n_p = np.clip(np.floor((up - persist) / cyc), 0.0, n)
        last = kd * np.floor((s0 + n_p) / kd)
        has = last > s0
        d_lost = w0 + work - np.where(has, (last - s0) * tau, 0.0)
        if s.peer_memory:
            n_m = np.clip(np.floor((up - mem_p) / cyc), 0.0, n)
            m_lost = work - n_m * tau
            fp = from_peer[:, i]
            lost = np.where(fp, m_lost, d_lost)
            new_w0 = np.where(fp, np.maximum(d_lost - m_lost, 0.0), 0.0)
            new_s0 = np.where(fp, np.maximum(np.where(has, s0 + n_m - last, s0 + n_m), 0.0), 0.0)
        else:
            lost = d_lost
            new_w0 = np.zeros(reps)
            new_s0 = np.zeros(reps)
        lost_acc += np.where(f_i, lost, 0.0)
        ev = f_i | pl_i
        w0 = np.where(ev, new_w0, w0)
        s0 = np.where(ev, new_s0, s0)
        w0 = np.where(pl_i, 0.0, w0)
        s0 = np.where(pl_i, 0.0, s0)
        r_prev = np.where(ev, cur.sum(axis=0), r_prev - spent)
        p_prev = np.where(ev[None, :], cur, p_prev * (1.0 - frac))
        t_prev = np.where(ev, ti, t_prev)

    productive = work_acc - lost_acc
    badput = {
        "ckpt_stall": stall_acc,
        "recompute": lost_acc,
        "detect": ph_acc[0],
        "replace": ph_acc[1],
        "restart": ph_acc[2],
        "load": ph_acc[3],
        "planned": ph_acc[4],
    }
    rows = np.broadcast_to(np.arange(reps)[:, None], cc.shape)[fail]
    by_cause = np.bincount(rows * n_c + cc[fail], minlength=reps * n_c).reshape(reps, n_c)
    by_source = {
        "base": (fail & (ss == SRC_BASE)).sum(axis=1),
        "lemon": (fail & (ss == SRC_LEMON)).sum(axis=1),
        "early": (fail & (ss == SRC_EARLY)).sum(axis=1),
    }
    return Result(
        scenario=sc,
        interval_s=tau,
        disk_every=kd,
        productive=productive,
        badput=badput,
        failures=fail.sum(axis=1),
        planned=planned.sum(axis=1),
        by_cause=by_cause,
        by_source=by_source,
        hw_failures=(fail & (ss == SRC_BASE) & replace_c[cc]).sum(axis=1),
        extra={"lemons": n_lemons},
    )

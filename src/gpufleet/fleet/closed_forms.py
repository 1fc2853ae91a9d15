"""Closed forms the simulator is checked against.

* Young (1974), "A first order approximation to the optimum checkpoint interval", CACM 17(9):
  τ = √(2δM).
* Daly (2006; online 2004), "A higher order estimate of the optimum checkpoint interval for restart
  dumps", FGCS 22(3): the optimum τ (``gpufleet.reliability.interval.daly``) and the expected wall
  time of a job needing T_s of work with exponential failures (mean M), checkpoint cost δ, restart R,
  failures possible at any time, restart included:  T_w = M·e^{R/M}·(e^{(τ+δ)/M} − 1)·T_s/τ.
* Kokolis et al. (HPCA 2025, arXiv 2410.21680), the expected effective training time ratio of a job
  on N nodes with per-node failure rate r_f, restart overhead u0, checkpoint write w every Δt:
  E[ETTR] ≈ (1 − N·r_f·(u0 + Δt/2)) / (1 + w/Δt), optimum Δt* = √(2w / (N·r_f)).
"""

from __future__ import annotations

import math

from gpufleet.reliability.interval import daly, young

__all__ = ["young", "daly", "daly_wall_ratio", "daly_waste", "hpca_ettr", "hpca_dt_opt", "mttf_hours"]


def daly_wall_ratio(tau: float, delta: float, mtbf: float, restart: float) -> float:
    """Daly's exact T_w / T_s for exponential failures (wall time per unit of work)."""
    return mtbf * math.exp(restart / mtbf) * math.expm1((tau + delta) / mtbf) / tau


def daly_waste(tau: float, delta: float, mtbf: float, restart: float) -> float:
    """Share of wall time that is not work: 1 − T_s/T_w."""
    return 1.0 - 1.0 / daly_wall_ratio(tau, delta, mtbf, restart)


def hpca_ettr(nodes: float, r_f_per_s: float, u0: float, dt: float, w: float) -> float:
    """Kokolis et al.'s expected ETTR (all times in seconds, r_f per node-second)."""
    lam = nodes * r_f_per_s
    return (1.0 - lam * (u0 + dt / 2.0)) / (1.0 + w / dt)


def hpca_dt_opt(nodes: float, r_f_per_s: float, w: float) -> float:
    """The checkpoint interval that maximises :func:`hpca_ettr` to first order."""
    return math.sqrt(2.0 * w / (nodes * r_f_per_s))


def mttf_hours(nodes: float, r_f_per_node_day: float) -> float:
    """The paper's projection: MTTF = 1 / (nodes · r_f), hours."""
    return 24.0 / (nodes * r_f_per_node_day)

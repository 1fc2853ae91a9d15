"""SLA capacity planner, data model: the options, a candidate deployment shape, the result, and the
split of a P/D deployment into NVLink-domain units."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from gpufleet.serve.common.plan_format import Mode
from gpufleet.serve.common.slo import SLO

__all__ = ["PlanOptions", "Candidate", "PlanResult", "pd_units"]


@dataclass(frozen=True)
class PlanOptions:
    slo: SLO
    domain_gpus: int = 8
    price_per_gpu_hour: float | None = None
    kv_gbps: float = 100.0  # P->D KV-cache transfer bandwidth, GB/s
    n_sim: int = 1500  # requests per single-instance simulation
    max_gpus: int = 1024
    modes: tuple[Mode, ...] = (Mode.AGGREGATED, Mode.DISAGGREGATED)
    seed: int = 0
    rel_tol: float = 0.02
    size_top: int = 10  # shapes simulated at full scale (the rest keep their estimate)
    chunked_prefill: int = 0  # aggregated engines: token budget per iteration (0 = no chunked prefill)


@dataclass
class Candidate:
    mode: Mode
    tp: int = 0  # aggregated
    replicas: int = 0
    max_batch: int = 0
    chunk: int = 0  # aggregated: chunked-prefill token budget (0 = whole prompts, prefill first)
    p_tp: int = 0  # disaggregated
    p_replicas: int = 0
    p_batch: int = 0
    d_tp: int = 0
    d_replicas: int = 0
    d_batch: int = 0
    unit_rate: float = 0.0  # per-instance max rate (aggregated) or min of phases
    feasible: bool = False
    note: str = ""
    eval: dict[str, Any] = field(default_factory=dict)
    max_rate: float = 0.0

    @property
    def gpus(self) -> int:
        if self.mode == Mode.AGGREGATED:
            return self.tp * self.replicas
        return self.p_tp * self.p_replicas + self.d_tp * self.d_replicas

    def label(self) -> str:
        if self.mode == Mode.AGGREGATED:
            chunk = f", chunk {self.chunk}" if self.chunk else ""
            return f"agg {self.replicas}x(TP{self.tp}, batch {self.max_batch}{chunk})"
        return (
            f"disagg {self.p_replicas}P(TP{self.p_tp}) + {self.d_replicas}D(TP{self.d_tp}, "
            f"batch {self.d_batch})"
        )

    def config(self) -> dict[str, Any]:
        if self.mode == Mode.AGGREGATED:
            return {
                "mode": self.mode,
                "tp": self.tp,
                "replicas": self.replicas,
                "max_batch": self.max_batch,
                "chunked_prefill": self.chunk,
                "gpus": self.gpus,
            }
        return {
            "mode": self.mode,
            "prefill": {"tp": self.p_tp, "replicas": self.p_replicas, "max_batch": self.p_batch},
            "decode": {"tp": self.d_tp, "replicas": self.d_replicas, "max_batch": self.d_batch},
            "gpus": self.gpus,
        }


@dataclass
class PlanResult:
    chosen: Candidate
    feasible: bool
    candidates: list[Candidate]
    runners_up: list[tuple[Candidate, str]]


def pd_units(c: Candidate, domain_gpus: int) -> list[tuple[list[int], list[int]]] | None:
    """Split P and D instances into the fewest units (each ≥1 P and ≥1 D, spread evenly) that each
    fit one NVLink domain; None if no split fits."""
    lo = max(1, math.ceil(c.gpus / domain_gpus))
    for k in range(lo, min(c.p_replicas, c.d_replicas) + 1):
        units = [
            ([i for i in range(c.p_replicas) if i % k == j], [i for i in range(c.d_replicas) if i % k == j])
            for j in range(k)
        ]
        if all(len(p) * c.p_tp + len(d) * c.d_tp <= domain_gpus for p, d in units):
            return units
    return None

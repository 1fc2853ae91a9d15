"""``gpufleet fleet simulate`` as a library: a request in, the summary object (``gpufleet.fleet/1``) out."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gpufleet.core.errors import ConfigError

__all__ = ["SCHEMA", "SWEEP_GPUS", "FleetRequest", "run", "ci95"]

SCHEMA = "gpufleet.fleet/1"
SWEEP_GPUS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 100000)
"""Job sizes of the goodput-vs-size plot."""


MAX_GPUS = 1_000_000
"""The largest job simulated (``--gpus``): ten times the largest sweep point, and its arrays fit in memory."""
MAX_DAYS = 3650.0
"""The longest wall time simulated (``--days``)."""
MAX_REPLICATES = 100_000
"""The most Monte Carlo replicates (``--replicates``)."""


@dataclass(kw_only=True, slots=True)
class FleetRequest:
    profile: str = "llama3-h100"
    """A shipped profile's name or a path to a TOML file."""
    gpus: int | None = None
    """GPUs in the job (default: the profile's basis job, else 16,384)."""
    days: float | None = None
    """Wall time simulated (default: the profile's basis, else 30 days)."""
    replicates: int = 500
    seed: int = 0
    interval_s: float | None = None
    """Checkpoint interval (work seconds); None: Young/Daly auto per strategy."""
    spares: int | None = None
    """Hot spares of the ``+spares`` strategies (default: 1% of the job's nodes, at least 2)."""
    from_run: Path | None = None
    only: list[str] = field(default_factory=list)
    """Simulate only these strategies (default: all eight)."""
    sweep: bool = True
    """Also simulate the sizes of SWEEP_GPUS (for the goodput-vs-size plot)."""
    sweep_replicates: int = 100

    def validate(self) -> None:
        if self.gpus is not None and not 1 <= self.gpus <= MAX_GPUS:
            raise ConfigError(f"--gpus must be 1 to {MAX_GPUS:,}, got {self.gpus}")
        if self.days is not None and not (0 < self.days <= MAX_DAYS):
            raise ConfigError(f"--days must be > 0 and <= {MAX_DAYS:g}, got {self.days}")
        if not 2 <= self.replicates <= MAX_REPLICATES:
            raise ConfigError(f"--replicates must be 2 to {MAX_REPLICATES:,}, got {self.replicates}")
        if self.interval_s is not None and not (self.interval_s > 0 and math.isfinite(self.interval_s)):
            raise ConfigError(f"--interval must be > 0 seconds or 'auto', got {self.interval_s}")
        if self.spares is not None and self.spares < 0:
            raise ConfigError(f"--spares must be >= 0, got {self.spares}")
        if self.seed < 0:
            raise ConfigError(f"--seed must be >= 0, got {self.seed}")


def ci95(x: np.ndarray) -> dict[str, float]:
    """Mean, its 95% confidence interval (normal, over replicates), and the 5th/95th percentiles."""
    x = np.asarray(x, dtype=float)
    m = float(x.mean())
    half = 1.96 * float(x.std(ddof=1)) / math.sqrt(len(x)) if len(x) > 1 else 0.0
    return {
        "mean": m,
        "ci_low": m - half,
        "ci_high": m + half,
        "p5": float(np.percentile(x, 5)),
        "p95": float(np.percentile(x, 95)),
    }


def _strategy_dict(res: Any) -> dict[str, Any]:
    from gpufleet.fleet.engine import BADPUT

    sc = res.scenario
    st = sc.strategy
    h = sc.horizon_s
    return {
        "name": st.name,
        "interval_s": res.interval_s,
        "disk_every": res.disk_every,
        "stall_s": st.stall_s,
        "persist_s": st.persist_s,
        "load_s": st.load_s,
        "peer_load_s": st.peer_load_s if st.peer_memory else None,
        "in_process": st.in_process,
        "hot_spares": st.hot_spares,
        "lemon_k": st.lemon_k,
        "screening": st.screening,
        "ettr": ci95(res.ettr),
        "badput_share": {k: ci95(res.badput[k] / h) for k in BADPUT},
        "failures": ci95(res.failures),
        "lemon_failures": float(res.by_source["lemon"].mean()),
        "early_failures": float(res.by_source["early"].mean()),
    }


def _basis(prof: Any) -> dict[str, Any] | None:
    """The job a profile's counts were observed on, with its published interruption counts."""
    b = prof.basis
    if not (b.gpus and b.days) or any(c.count is None for c in prof.cause):
        return None
    return {
        "gpus": b.gpus,
        "days": b.days,
        "unexpected": sum(c.count or 0 for c in prof.cause),
        "planned": b.planned,
    }


def run(req: FleetRequest, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Simulate every strategy at the requested size (and the sweep); the summary object."""
    from gpufleet.fleet.calibrate import apply, from_run
    from gpufleet.fleet.engine import Scenario, simulate
    from gpufleet.fleet.profiles import load_profile
    from gpufleet.fleet.strategies import strategies

    req.validate()
    prof = load_profile(req.profile)
    cal = None
    if req.from_run is not None:
        cal = from_run(req.from_run)
        prof = apply(prof, cal)
    gpus = req.gpus or prof.basis.gpus or 16384
    days = req.days or prof.basis.days or 30.0

    def table(n_gpus: int) -> list[Any]:
        sts = strategies(prof, n_gpus, cal=cal, spares=req.spares, interval_s=req.interval_s)
        if req.only:
            names = {s.name for s in sts}
            bad = [x for x in req.only if x not in names]
            if bad:
                raise ConfigError(f"unknown strategy {bad[0]!r}; valid: {', '.join(sorted(names))}")
            sts = [s for s in sts if s.name in req.only]
        return sts

    say = progress or (lambda _msg: None)
    results = []
    for st in table(gpus):
        say(f"{st.name} at {gpus:,} GPUs")
        results.append(simulate(Scenario.build(prof, gpus, days, st), req.replicates, req.seed))
    first = results[0]
    h = first.scenario.horizon_s
    n_fail = first.failures
    mtbf_h = h / 3600.0 / max(float(n_fail.mean()), 1e-12)
    causes = [
        {"cause": name, **ci95(first.by_cause[:, j]), "per_day": float(first.by_cause[:, j].mean()) / days}
        for j, name in enumerate(first.scenario.cause_names)
    ]
    sweep: dict[str, list[float]] = {}
    sizes = [g for g in SWEEP_GPUS if g != gpus] + [gpus]
    sizes = sorted(set(sizes)) if req.sweep else []
    for g in sizes:
        say(f"sweep {g:,} GPUs")
        for st in table(g):
            r = simulate(Scenario.build(prof, g, days, st), req.sweep_replicates, req.seed)
            sweep.setdefault(st.name, []).append(float(r.ettr.mean()))
    return {
        "schema": SCHEMA,
        "profile": prof.name,
        "profile_description": prof.description,
        "gpus": gpus,
        "nodes": first.scenario.nodes,
        "days": days,
        "replicates": req.replicates,
        "seed": req.seed,
        "calibration": cal.to_dict() if cal else None,
        "recovery_s": prof.recovery.model_dump(),
        "basis": _basis(prof),
        "interruptions": {
            "unexpected": ci95(n_fail),
            "planned": ci95(first.planned),
            "by_cause": causes,
            "lemon": float(first.by_source["lemon"].mean()),
            "early_life": float(first.by_source["early"].mean()),
            "mtbf_h": mtbf_h,
        },
        "strategies": [_strategy_dict(r) for r in results],
        "sweep": {"gpus": sizes, "ettr": sweep, "replicates": req.sweep_replicates} if sizes else None,
    }

"""``--from-run``: take recovery phases, checkpoint stall/persist and step time from a run's ledger.

Everything comes from :func:`gpufleet.reliability.metrics.summarize` (the same numbers ``gpufleet
report`` prints), so the ledger stays the one source of truth:

* detect = the mean ``detect`` phase of the recovered incidents;
* restart = teardown + spawn_init + first_step (gpufleet's supervisor relaunches the ranks);
* load = the mean ``load`` phase (the persistent tier);
* stall, persist = the medians of the committed checkpoints (gpufleet's asynchronous engine);
* step = the mean step time.

Failure rates still come from the profile: a run's own failures are drills, not a fleet's rate.
A phase the run did not measure (no incident, no checkpoint) keeps the profile's value.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpufleet.core.errors import UsageError

if TYPE_CHECKING:
    from gpufleet.fleet.profiles import Profile

__all__ = ["Calibration", "from_run", "apply"]


@dataclass(kw_only=True, slots=True, frozen=True)
class Calibration:
    run_dir: str
    """The run directory the figures come from."""
    world_size: int | None = None
    """Ranks of the run (its measurements are assumed to hold at the simulated size)."""
    incidents: int = 0
    """Recovered incidents the phases are averaged over."""
    checkpoints: int = 0
    """Committed checkpoints the stall and persist medians come from."""
    step_s: float = 0.0
    detect_s: float | None = None
    restart_s: float | None = None
    load_s: float | None = None
    stall_s: float = 0.0
    persist_s: float = 0.0

    @property
    def has_checkpoints(self) -> bool:
        return self.checkpoints > 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def from_run(run_dir: str | Path) -> Calibration:
    """Read the run directory's ledger; UsageError when it is not a gpufleet run directory."""
    from gpufleet.core.ledger import LEDGER_NAME, read_events
    from gpufleet.reliability.metrics import summarize

    d = Path(run_dir)
    if not d.is_dir():
        raise UsageError(f"run directory not found: {d}")
    ledger = d / LEDGER_NAME
    if not ledger.is_file():
        raise UsageError(f"no ledger in {d} (expected {LEDGER_NAME}); is this a gpufleet run directory?")
    events = read_events(ledger)
    if not events:
        raise UsageError(f"the ledger {ledger} holds no events")
    s = summarize(events, run_dir=str(d))
    mttr = s["mttr"]
    ph = mttr["phases_mean_s"]
    n_inc = int(mttr["count"] or 0)
    ck = s["checkpoints"]
    n_ck = int(ck["committed"] or 0)
    step = s["steps"]["mean_step_s"]
    if not step:
        raise UsageError(f"the ledger {ledger} records no training steps; nothing to calibrate from")
    world = next((int(e["world_size"]) for e in events if e.get("world_size")), None)

    def phase(*names: str) -> float | None:
        if not n_inc:
            return None
        return float(sum(ph[n] or 0.0 for n in names))

    return Calibration(
        run_dir=str(d),
        world_size=world,
        incidents=n_inc,
        checkpoints=n_ck,
        step_s=float(step),
        detect_s=phase("detect"),
        restart_s=phase("teardown", "spawn_init", "first_step"),
        load_s=phase("load"),
        stall_s=float(ck["stall_s"]["p50"] or 0.0) if n_ck else 0.0,
        persist_s=float(ck["persist_s"]["p50"] or 0.0) if n_ck else 0.0,
    )


def apply(profile: Profile, cal: Calibration) -> Profile:
    """The profile with the run's measured recovery phases in place of its assumed ones."""
    upd: dict[str, float] = {}
    if cal.detect_s is not None:
        upd["detect_s"] = cal.detect_s
    if cal.restart_s is not None:
        upd["restart_s"] = cal.restart_s
        # In-process restart is not measured by gpufleet; keep the profile's, never above the restart.
        upd["inproc_restart_s"] = min(profile.recovery.inproc_restart_s, cal.restart_s)
    return profile.model_copy(update={"recovery": profile.recovery.model_copy(update=upd)})

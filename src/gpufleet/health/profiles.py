"""Hardware profiles (data: ``health/data/profiles.toml``): thresholds per metric, relative settings.

Checks measure in SI units (flop/s, B/s, s, counts); a :class:`Threshold` carries the display unit and
converts. ``fail_below``/``warn_below`` are floors, ``fail_above``/``warn_above`` ceilings.
"""

from __future__ import annotations

import tomllib
from importlib import resources
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gpufleet.core.errors import UsageError
from gpufleet.health.results import Status

__all__ = ["UNITS", "Threshold", "Profile", "load_profiles", "get_profile", "detect_profile"]

UNITS: dict[str, float] = {
    "TFLOPS": 1e12,
    "GFLOPS": 1e9,
    "GB/s": 1e9,
    "MB/s": 1e6,
    "GB": 1e9,
    "ms": 1e-3,
    "s": 1.0,
    "C": 1.0,
    "count": 1.0,
    "gen": 1.0,
    "lanes": 1.0,
    "links": 1.0,
    "pages": 1.0,
    "W": 1.0,
    "%": 1.0,
    "per_min": 1.0,
    "Gb/s": 1e9,
}


class Threshold(BaseModel):
    model_config = ConfigDict(extra="forbid")
    unit: str
    fail_below: float | None = None
    warn_below: float | None = None
    fail_above: float | None = None
    warn_above: float | None = None

    def scale(self, si_value: float) -> float:
        """An SI value in this threshold's unit."""
        return si_value / UNITS.get(self.unit, 1.0)

    def judge(self, value: float) -> tuple[Status, float | None]:
        """(status, the limit that decided it) for a value already in ``unit``."""
        if self.fail_below is not None and value < self.fail_below:
            return Status.FAIL, self.fail_below
        if self.fail_above is not None and value > self.fail_above:
            return Status.FAIL, self.fail_above
        if self.warn_below is not None and value < self.warn_below:
            return Status.WARN, self.warn_below
        if self.warn_above is not None and value > self.warn_above:
            return Status.WARN, self.warn_above
        limit = self.fail_below if self.fail_below is not None else self.fail_above
        return Status.OK, limit if limit is not None else (self.warn_below or self.warn_above)


class Profile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    description: str = ""
    match: list[str] = Field(default_factory=list)
    gpus: int = Field(ge=0)
    peer_tol: float = Field(0.10, gt=0, lt=1)
    mad_k: float = Field(3.0, gt=0)
    mad_min_drop: float = Field(0.05, ge=0, lt=1)
    fleet_min_peers: int = Field(3, ge=1)
    thresholds: dict[str, Threshold] = Field(default_factory=dict)

    def threshold(self, metric: str) -> Threshold | None:
        return self.thresholds.get(metric)


def _raw() -> dict[str, Any]:
    text = resources.files("gpufleet.health").joinpath("data/profiles.toml").read_text()
    return tomllib.loads(text)


def load_profiles() -> dict[str, Profile]:
    raw = _raw()
    defaults = raw.pop("defaults", {})
    out: dict[str, Profile] = {}
    for name, body in raw.items():
        merged = {k: v for k, v in defaults.items() if k != "thresholds"}
        merged.update({k: v for k, v in body.items() if k != "thresholds"})
        merged["thresholds"] = {**defaults.get("thresholds", {}), **body.get("thresholds", {})}
        try:
            out[name] = Profile(name=name, **merged)
        except ValidationError as e:  # shipped data: a bug, but say which profile
            raise UsageError(f"profile {name}: {e.errors()[0]['msg']}") from None
    return out


def get_profile(name: str) -> Profile:
    profiles = load_profiles()
    for key, p in profiles.items():
        if key.lower() == name.lower():
            return p
    raise UsageError(f"unknown profile {name!r}; valid: {', '.join(profiles)}")


def detect_profile(gpu_names: list[str]) -> Profile:
    """The profile whose ``match`` strings occur in the first GPU's name; CPU without GPUs."""
    profiles = load_profiles()
    if gpu_names:
        for p in profiles.values():
            if any(m.lower() in gpu_names[0].lower() for m in p.match):
                return p
        raise UsageError(
            f"no profile matches GPU {gpu_names[0]!r}; pass --profile (valid: {', '.join(profiles)})"
        )
    return profiles["CPU"]

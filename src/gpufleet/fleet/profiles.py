"""Fleet profiles: failure causes and their rates, recovery phases, checkpoint sizes (data files).

A profile is a TOML file. Two ship with gpufleet (``fleet/profiles/*.toml``), each citing its source
line by line; a user passes a path to their own. Rates are stored per node-day (they scale with the
job's node count) or per job-day (they do not); a cause may instead give a ``count`` observed over
the ``[basis]`` job (GPUs x days), which is converted to a per-node-day rate.
"""

from __future__ import annotations

import tomllib
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from gpufleet.core.errors import ConfigError

__all__ = [
    "Cause",
    "Basis",
    "EarlyLife",
    "Lemon",
    "Recovery",
    "CheckpointIO",
    "Reference",
    "Profile",
    "builtin_profiles",
    "load_profile",
]

DAY_S = 86400.0


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Basis(_Model):
    """The observed job a profile's counts come from."""

    gpus: int | None = Field(None, gt=0)
    days: float | None = Field(None, gt=0)
    planned: int | None = Field(None, ge=0)
    """Planned interruptions over the basis job (job-level: they do not scale with size)."""
    planned_per_day: float | None = Field(None, ge=0)


class Cause(_Model):
    """One failure cause. Exactly one of ``count``, ``per_node_day``, ``per_job_day``."""

    name: str
    kind: Literal["gpu", "host", "network", "software"] = "gpu"
    count: int | None = Field(None, ge=0)
    per_node_day: float | None = Field(None, ge=0)
    per_job_day: float | None = Field(None, ge=0)
    replace: bool = True
    """The node must be taken out: swapped for a hot spare, or the job requeued."""
    peer_survives: bool = True
    """An in-memory checkpoint replica held by peer nodes survives this failure."""

    @model_validator(mode="after")
    def _one_rate(self) -> Cause:
        given = [x for x in (self.count, self.per_node_day, self.per_job_day) if x is not None]
        if len(given) != 1:
            raise ValueError(f"cause {self.name!r}: give exactly one of count, per_node_day, per_job_day")
        return self


class EarlyLife(_Model):
    """Infant mortality: a node that joins (a replacement) fails early with this probability."""

    probability: float = Field(0.0, ge=0, le=1)
    window_h: float = Field(72.0, gt=0)
    """Mean time to the early failure after the node joins (exponential), hours."""


class Lemon(_Model):
    """Lemon nodes: this share of nodes fails at ``multiplier`` x the base node hardware rate."""

    fraction: float = Field(0.0, ge=0, le=1)
    multiplier: float = Field(1.0, ge=1)


class Recovery(_Model):
    """Phase times of a recovery, seconds (``repair_h``: hours until a replaced node is a spare again)."""

    detect_s: float = Field(60.0, ge=0)
    spare_swap_s: float = Field(120.0, ge=0)
    requeue_s: float = Field(1800.0, ge=0)
    restart_s: float = Field(180.0, ge=0)
    inproc_restart_s: float = Field(30.0, ge=0)
    repair_h: float = Field(72.0, gt=0)


class CheckpointIO(_Model):
    """Checkpoint bytes and bandwidths per GPU; the strategies' stall/persist/load times derive from them."""

    bytes_per_gpu: float = Field(3.5e8, gt=0)
    write_gbps_per_gpu: float = Field(0.1, gt=0)
    read_gbps_per_gpu: float = Field(0.2, gt=0)
    host_copy_gbps: float = Field(10.0, gt=0)
    peer_gbps: float = Field(5.0, gt=0)
    min_interval_s: float = Field(0.0, ge=0)
    """A floor on the checkpoint interval (storage cost, interference with training)."""


class Reference(_Model):
    """The strategy the validation runs a profile with."""

    strategy: str = "sync"


class Profile(_Model):
    name: str
    description: str = ""
    gpus_per_node: int = Field(8, gt=0)
    basis: Basis = Basis()
    cause: list[Cause] = Field(min_length=1)
    early_life: EarlyLife = EarlyLife()
    lemon: Lemon = Lemon()
    recovery: Recovery = Recovery()
    checkpoint: CheckpointIO = CheckpointIO()
    reference: Reference = Reference()

    @model_validator(mode="after")
    def _basis_for_counts(self) -> Profile:
        if any(c.count is not None for c in self.cause) and not (self.basis.gpus and self.basis.days):
            raise ValueError("causes given as count need [basis] gpus and days")
        if self.basis.planned is not None and not self.basis.days:
            raise ValueError("[basis] planned needs [basis] days")
        return self

    # -- rates, per second --------------------------------------------------------------------------

    def node_rate(self, c: Cause) -> float:
        """Failures per node-second of a cause that scales with size (0 for a per-job cause)."""
        if c.per_node_day is not None:
            return c.per_node_day / DAY_S
        if c.count is not None:
            assert self.basis.gpus and self.basis.days
            nodes = self.basis.gpus / self.gpus_per_node
            return c.count / (nodes * self.basis.days * DAY_S)
        return 0.0

    def job_rate(self, c: Cause) -> float:
        """Failures per job-second of a cause that does not scale with size."""
        return (c.per_job_day or 0.0) / DAY_S

    def cause_rate(self, c: Cause, nodes: float) -> float:
        """Failures per second of one cause for a job of ``nodes`` nodes."""
        return self.node_rate(c) * nodes + self.job_rate(c)

    def planned_rate(self) -> float:
        """Planned interruptions per second (job-level)."""
        if self.basis.planned_per_day is not None:
            return self.basis.planned_per_day / DAY_S
        if self.basis.planned is not None and self.basis.days:
            return self.basis.planned / (self.basis.days * DAY_S)
        return 0.0

    def hardware_node_rate(self) -> float:
        """Per-node rate of the causes that take a node out (the base a lemon multiplies)."""
        return sum(self.node_rate(c) for c in self.cause if c.replace)

    def with_lemons(self, fraction: float, multiplier: float) -> Profile:
        return self.model_copy(update={"lemon": Lemon(fraction=fraction, multiplier=multiplier)})


_PKG = "gpufleet.fleet"


def builtin_profiles() -> list[str]:
    """Names of the shipped profiles."""
    root = resources.files(_PKG).joinpath("profiles")
    return sorted(p.name.removesuffix(".toml") for p in root.iterdir() if p.name.endswith(".toml"))


def _parse(text: str, origin: str) -> Profile:
    try:
        raw: dict[str, Any] = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"fleet profile {origin}: not valid TOML ({e})") from None
    try:
        return Profile(**raw)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "profile"
        raise ConfigError(f"fleet profile {origin}: {where}: {err['msg']}") from None


def load_profile(name_or_path: str | Path) -> Profile:
    """A shipped profile by name (``llama3-h100``, ``rsc-a100``) or a user TOML file by path."""
    s = str(name_or_path)
    names = builtin_profiles()
    if s in names:
        text = resources.files(_PKG).joinpath("profiles", f"{s}.toml").read_text()
        return _parse(text, s)
    p = Path(s)
    if p.suffix == ".toml" or p.exists():
        try:
            return _parse(p.read_text(), str(p))
        except OSError as e:
            raise ConfigError(f"fleet profile {p}: cannot read it ({e.strerror})") from None
    raise ConfigError(f"unknown fleet profile {s!r}; valid: {', '.join(names)}, or a path to a TOML file")

"""Settings: every ``GPUFLEET_*`` environment variable, and the worker contract (:class:`RunSettings`).

One prefix, one table: :class:`gpufleet.core.env.Env` declares every variable gpufleet reads (it lives
in a module without pydantic, so light code such as the CLI can use it); code reads them through
their declarations (``Env.AGENT_GRACE.get()``) or the models here, never by a string literal of its own.

:class:`RunSettings` is what a training worker runs with. Its values come from, lowest first:
defaults <- ``gpufleet.init(**kw)`` <- environment. The supervisor's flags travel to workers as
environment variables, so ``gpufleet run --keep-last 5`` overrides what the script passed to ``init``.
The supervisor validates the very same model (:meth:`RunSettings.for_workers`) before it launches
anything, so a value a worker would reject stops ``gpufleet run`` with one line and exit code 2.

Why a plain pydantic model and not pydantic-settings' ``BaseSettings``: the two sides layer the same
fields in different orders (worker: environment over ``init()`` keywords; supervisor: flags over its
inherited environment), both must read a given mapping rather than ``os.environ``, several variables
have short names (``GPUFLEET_CKPT_EVERY``, ``GPUFLEET_UPLOAD``), and errors must name
the flag or variable the value came from. That is a 20-line loader over one table, not a dependency.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from gpufleet.core.env import Env, Var, read_env
from gpufleet.core.errors import ConfigError
from gpufleet.core.units import INTERVAL_FORMS, parse_interval

__all__ = [
    "Env",
    "read_env",
    "RollbackPlan",
    "RunSettings",
    "SETTING_ENV",
    "SETTING_FLAG",
    "validation_message",
    "parse_size",
    "SIZE_FORMS",
]


class RollbackPlan(BaseModel):
    """The supervisor's loss-spike decision for the next attempt (``GPUFLEET_ROLLBACK``, JSON).

    ``max_step``: restore from the newest checkpoint at or before this step (None: the newest).
    ``skip``: half-open step windows ``[a, b)`` whose batches the worker skips.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_step: int | None = Field(None, ge=0)
    skip: tuple[tuple[int, int], ...] = ()

    @field_validator("skip")
    @classmethod
    def _windows(cls, v: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
        for a, b in v:
            if not 0 <= a < b:
                raise ValueError(f"skip window [{a}, {b}) must have 0 <= start < end")
        return v

    def to_env(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_env(cls, raw: str) -> RollbackPlan:
        return cls.model_validate_json(raw)


SIZE_FORMS = "use a size such as 512MiB, 2GiB, 1.5GB or a byte count (0: off)"
_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_SIZE_UNITS |= {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: Any) -> int:
    """Bytes of ``2GiB`` / ``1.5GB`` / ``512MiB`` / ``1048576``; ValueError (a one-line message) else."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    m = _SIZE_RE.match(value) if isinstance(value, str) else None
    unit = _SIZE_UNITS.get(m.group(2).lower()) if m else None
    if m is None or unit is None:
        raise ValueError(f"invalid size; {SIZE_FORMS}")
    return int(float(m.group(1)) * unit)


# field -> environment variable, for the settings users set (flags, init() keywords, environment)
SETTING_ENV: dict[str, Var[str]] = {
    "run_dir": Env.RUN_DIR,
    "checkpoint_every": Env.CKPT_EVERY,
    "checkpoint_dir": Env.CKPT_DIR,
    "keep_last": Env.KEEP_LAST,
    "upload_url": Env.UPLOAD,
    "s3_endpoint": Env.S3_ENDPOINT,
    "mtbf_s": Env.MTBF,
    "spike_window": Env.SPIKE_WINDOW,
    "spike_threshold": Env.SPIKE_THRESHOLD,
    "spike_level": Env.SPIKE_LEVEL,
    "overlap_staging": Env.OVERLAP,
    "memory_tier": Env.MEMORY_TIER,
    "dist_backend": Env.DIST_BACKEND,
}
# field -> the `gpufleet run` flag that sets it
SETTING_FLAG: dict[str, str] = {
    "run_dir": "--run-dir",
    "checkpoint_every": "--checkpoint-every",
    "keep_last": "--keep-last",
    "upload_url": "--upload",
    "s3_endpoint": "--s3-endpoint",
    "mtbf_s": "--mtbf",
    "memory_tier": "--memory-tier",
    "dist_backend": "--dist-backend",
}
# field -> variable, for what only the supervisor sets
_PLUMBING_ENV: dict[str, Var[str]] = {
    "control_fd": Env.CONTROL_FD,
    "attempt": Env.ATTEMPT,
    "session": Env.SESSION,
    "faults": Env.FAULTS,
    "rollback": Env.ROLLBACK,
}


class RunSettings(BaseModel):
    """A worker's settings (docs/supervisor.md, "Configuration"). Build one with :meth:`load`."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    run_dir: str = Field("runs/default", min_length=1)
    checkpoint_every: str = "auto"  # "N" / "Nsteps" / "90s" / "auto" (Young/Daly)
    checkpoint_dir: str | None = None  # default RUN_DIR/checkpoints
    keep_last: int = Field(3, ge=1)
    upload_url: str | None = None  # s3://bucket/prefix for tiered copies
    s3_endpoint: str | None = None
    mtbf_s: float | None = Field(None, gt=0)  # configured MTBF for `auto` before the ledger has failures
    spike_window: int = Field(50, ge=3)
    spike_threshold: float = Field(8.0, gt=0)
    spike_level: float = Field(0.1, ge=0)  # a spike exceeds the median by this x the run's loss scale
    overlap_staging: bool = True  # copy params/optimizer state during the next forward/backward
    memory_tier: int = 0  # bytes of host memory for the in-memory checkpoint tier ("2GiB"); 0: off
    # torch.distributed backend. auto: NCCL for CUDA tensors and gloo for CPU ones where there is a GPU
    # (one per local rank), gloo alone otherwise; gloo: gloo for both, ranks may share a GPU.
    dist_backend: Literal["auto", "nccl", "gloo"] = "auto"
    # Set by the supervisor only:
    control_fd: int | None = Field(None, ge=0)
    attempt: int = Field(0, ge=0)
    session: str | None = None
    faults: str | None = None
    rollback: RollbackPlan = RollbackPlan()

    @field_validator("checkpoint_every", mode="before")
    @classmethod
    def _interval(cls, v: Any) -> str:
        if isinstance(v, bool) or not isinstance(v, str | int):
            raise ValueError(f"invalid checkpoint interval; {INTERVAL_FORMS}")
        try:
            return parse_interval(v).spec
        except ConfigError:
            raise ValueError(f"invalid checkpoint interval; {INTERVAL_FORMS}") from None

    @field_validator("memory_tier", mode="before")
    @classmethod
    def _memory_tier(cls, v: Any) -> int:
        return parse_size(v)

    @field_validator("upload_url")
    @classmethod
    def _upload(cls, v: str | None) -> str | None:
        if v is not None and not (v.startswith("s3://") and len(v) > len("s3://")):
            raise ValueError("must look like s3://bucket/prefix")
        return v

    @field_validator("s3_endpoint")
    @classmethod
    def _endpoint(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// URL")
        return v

    @field_validator("rollback", mode="before")
    @classmethod
    def _rollback(cls, v: Any) -> Any:
        if not isinstance(v, str):
            return v
        try:
            return json.loads(v)
        except ValueError:
            raise ValueError("is not valid JSON") from None

    @property
    def ckpt_dir(self) -> Path:
        return Path(self.checkpoint_dir) if self.checkpoint_dir else Path(self.run_dir) / "checkpoints"

    # ------------------------------------------------------------------ building
    @classmethod
    def load(cls, env: Mapping[str, str] | None = None, /, **kwargs: Any) -> RunSettings:
        """The worker's side: defaults <- ``init()`` keywords <- environment (``os.environ``)."""
        for k in kwargs:
            if k not in SETTING_ENV:
                raise ConfigError(f"unknown gpufleet.init() option {k!r}; valid: {', '.join(SETTING_ENV)}")
        layers: list[tuple[dict[str, Any], Callable[[str], str]]] = [
            (dict(kwargs), lambda f: f"gpufleet.init({f}=...)"),
            (_from_env(env, SETTING_ENV), lambda f: str(SETTING_ENV[f])),
            (_from_env(env, _PLUMBING_ENV), lambda f: str(_PLUMBING_ENV[f])),
        ]
        return cls._build(layers)

    @classmethod
    def for_workers(cls, flags: Mapping[str, Any], env: Mapping[str, str] | None = None) -> RunSettings:
        """The supervisor's side: what every worker will see before its ``init()`` keywords.

        Defaults <- the inherited environment <- the supervisor's ``flags`` (field -> value, None = unset).
        """
        layers: list[tuple[dict[str, Any], Callable[[str], str]]] = [
            (_from_env(env, SETTING_ENV), lambda f: str(SETTING_ENV[f])),
            ({k: v for k, v in flags.items() if v is not None}, lambda f: SETTING_FLAG.get(f, f)),
        ]
        return cls._build(layers)

    @staticmethod
    def to_env(values: Mapping[str, Any]) -> dict[str, str]:
        """Worker environment variables for setting fields (None values are left out)."""
        out = {}
        for name, value in values.items():
            if value is not None:
                out[str(SETTING_ENV[name])] = str(int(value) if isinstance(value, bool) else value)
        return out

    @classmethod
    def _build(cls, layers: list[tuple[dict[str, Any], Callable[[str], str]]]) -> RunSettings:
        values: dict[str, Any] = {}
        origin: dict[str, str] = {}
        for layer, name_of in layers:
            for field, value in layer.items():
                values[field] = value
                origin[field] = name_of(field)
        try:
            return cls(**values)
        except ValidationError as e:
            raise ConfigError(validation_message(e, origin, values)) from None


def _from_env(env: Mapping[str, str] | None, table: Mapping[str, Var[str]]) -> dict[str, str]:
    return {field: raw for field, var in table.items() if (raw := var.raw(env))}


_MESSAGES: dict[str, Callable[[dict[str, Any]], str]] = {
    "greater_than_equal": lambda c: f"must be >= {c['ge']:g}",
    "greater_than": lambda c: f"must be > {c['gt']:g}",
    "int_parsing": lambda c: "must be an integer",
    "int_type": lambda c: "must be an integer",
    "int_from_float": lambda c: "must be an integer",
    "float_parsing": lambda c: "must be a number",
    "float_type": lambda c: "must be a number",
    "finite_number": lambda c: "must be a finite number",
    "bool_parsing": lambda c: "must be true or false (1/0, yes/no)",
    "bool_type": lambda c: "must be true or false",
    "string_type": lambda c: "must be a string",
    "string_too_short": lambda c: "must not be empty",
    "json_invalid": lambda c: "is not valid JSON",
}


def validation_message(e: ValidationError, origin: Mapping[str, str], values: Mapping[str, Any]) -> str:
    """``--keep-last 0: must be >= 1``: the first problem, named by where its value came from.

    ``origin`` maps a field to a flag (``--keep-last``), a variable (``GPUFLEET_KEEP_LAST``) or
    ``gpufleet.init(...)``; ``values`` are the raw inputs.
    """
    err = e.errors()[0]
    loc = err["loc"]
    field = str(loc[0]) if loc else ""
    where = origin.get(field, field)
    raw = values.get(field, err.get("input"))
    if where.startswith("gpufleet.init("):
        where = f"gpufleet.init({field}={raw!r})"
    else:
        where = f"{where}={raw!r}" if where.startswith("GPUFLEET_") else f"{where} {raw!r}"
    make = _MESSAGES.get(err["type"])
    msg = make(err.get("ctx") or {}) if make else str(err["msg"]).removeprefix("Value error, ")
    if len(loc) > 1:
        msg = f"{'.'.join(str(p) for p in loc[1:])}: {msg}"
    return f"{where}: {msg}".replace("\n", " ")

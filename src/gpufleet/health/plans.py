"""Declarative check plans (TOML, validated with pydantic): built-in tiers and user files.

Built-in tiers live in ``health/data/plan_<name>.toml``: ``quick`` (<= 30 s, for a prolog or
HealthCheckProgram), ``postfail`` (<= 5 min, after a job failure) and ``acceptance`` (node admission).
"""

from __future__ import annotations

import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from gpufleet.core.errors import UsageError

__all__ = ["TIERS", "PlanCheck", "Plan", "load_plan"]

TIERS = ("quick", "postfail", "acceptance")


class PlanCheck(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    timeout_s: float | None = Field(None, gt=0, le=3600)
    params: dict[str, Any] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        from gpufleet.health.checks import registry

        names = registry()
        if v not in names:
            raise ValueError(f"unknown check {v!r}; valid: {', '.join(names)}")
        return v


class Plan(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    description: str = ""
    budget_s: float = Field(gt=0, le=24 * 3600)
    valid_s: float = Field(3600.0, gt=0, description="how long the results stay valid")
    checks: list[PlanCheck] = Field(min_length=1)


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err["loc"])
    return f"{loc}: {err['msg'].removeprefix('Value error, ')}" if loc else err["msg"]


def parse_plan(data: dict[str, Any], source: str) -> Plan:
    try:
        return Plan(**data)
    except ValidationError as e:
        raise UsageError(f"invalid plan {source}: {_first_error(e)}") from None
    except TypeError as e:
        raise UsageError(f"invalid plan {source}: {e}") from None


def load_plan(name_or_path: str) -> Plan:
    """A built-in tier by name, or a TOML file. Bad input raises a one-line :class:`UsageError`."""
    if name_or_path in TIERS:
        text = resources.files("gpufleet.health").joinpath(f"data/plan_{name_or_path}.toml").read_text()
        return parse_plan(tomllib.loads(text), name_or_path)
    p = Path(name_or_path)
    if not p.is_file():
        raise UsageError(f"unknown plan {name_or_path!r}; valid: {', '.join(TIERS)} or a TOML file path")
    try:
        data = tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"malformed plan file {p}: {e}") from None
    return parse_plan(data, str(p))

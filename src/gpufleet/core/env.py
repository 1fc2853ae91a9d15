"""Every ``GPUFLEET_*`` environment variable gpufleet reads, named in one place, and a typed reader.

Standard library only, so the CLI and ``import gpufleet`` stay light. The worker contract built on
these names is :class:`gpufleet.core.settings.RunSettings`; docs/supervisor.md lists the settings.
Test-only variables (``GPUFLEET_TEST_*``) belong to tests/ and are not here.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from enum import StrEnum
from typing import TypeVar

from gpufleet.core.errors import ConfigError

__all__ = ["Env", "read_env"]

T = TypeVar("T")


class Env(StrEnum):
    """Every ``GPUFLEET_*`` variable gpufleet reads (test-only ``GPUFLEET_TEST_*`` live in tests/)."""

    # Worker settings (RunSettings); the supervisor sets them from its flags.
    RUN_DIR = "GPUFLEET_RUN_DIR"
    CKPT_EVERY = "GPUFLEET_CKPT_EVERY"
    CKPT_DIR = "GPUFLEET_CKPT_DIR"
    KEEP_LAST = "GPUFLEET_KEEP_LAST"
    UPLOAD = "GPUFLEET_UPLOAD"
    S3_ENDPOINT = "GPUFLEET_S3_ENDPOINT"
    MTBF = "GPUFLEET_MTBF"
    SPIKE_WINDOW = "GPUFLEET_SPIKE_WINDOW"
    SPIKE_THRESHOLD = "GPUFLEET_SPIKE_THRESHOLD"
    SPIKE_LEVEL = "GPUFLEET_SPIKE_LEVEL"
    OVERLAP = "GPUFLEET_OVERLAP"
    MEMORY_TIER = "GPUFLEET_MEMORY_TIER"  # in-memory checkpoint tier budget (2GiB; 0: off)
    MEMORY_TIER_DIR = "GPUFLEET_MEMORY_TIER_DIR"  # where its keepers live (default /dev/shm; %n: node name)
    DIST_BACKEND = "GPUFLEET_DIST_BACKEND"  # torch.distributed backend: auto, nccl, gloo
    # Supervisor -> worker plumbing (set by the supervisor and its backends, never by users).
    CONTROL_FD = "GPUFLEET_CONTROL_FD"
    ATTEMPT = "GPUFLEET_ATTEMPT"
    SESSION = "GPUFLEET_SESSION"
    FAULTS = "GPUFLEET_FAULTS"
    ROLLBACK = "GPUFLEET_ROLLBACK"
    SPAWN_T = "GPUFLEET_SPAWN_T"
    STANDBY_EAGER = "GPUFLEET_STANDBY_EAGER"
    IN_PROCESS = "GPUFLEET_IN_PROCESS"  # "1": this rank may rejoin a new round in place (train/inprocess.py)
    SPARE = "GPUFLEET_SPARE"  # a hot spare's rank guess: it builds and waits in run.restore (train/run.py)
    SPARE_READY = "GPUFLEET_SPARE_READY"  # the file a hot spare creates once built (backends/local.py)
    AGENT_SPEC = "GPUFLEET_AGENT_SPEC"
    AGENT_GRACE = "GPUFLEET_AGENT_GRACE"
    # Health (docs/health.md).
    FLEET_DIR = "GPUFLEET_FLEET_DIR"
    NODE = "GPUFLEET_NODE"
    LEMON_FAILURES = "GPUFLEET_LEMON_FAILURES"
    LEMON_WINDOW_DAYS = "GPUFLEET_LEMON_WINDOW_DAYS"
    BREAKER_FRACTION = "GPUFLEET_BREAKER_FRACTION"
    BREAKER_WINDOW_S = "GPUFLEET_BREAKER_WINDOW_S"
    NVML_MODULE = "GPUFLEET_NVML_MODULE"
    FAKE_NVML = "GPUFLEET_FAKE_NVML"
    KERNEL_LOG = "GPUFLEET_KERNEL_LOG"
    CLOCK_FILE = "GPUFLEET_CLOCK_FILE"
    HEALTH_PATHS = "GPUFLEET_HEALTH_PATHS"
    HEALTH_INJECT_SLOW = "GPUFLEET_HEALTH_INJECT_SLOW"
    # Serving.
    CACHE_DIR = "GPUFLEET_CACHE_DIR"
    SERVE_LOOP = "GPUFLEET_SERVE_LOOP"


def read_env(var: Env, cast: Callable[[str], T], default: T, env: Mapping[str, str] | None = None) -> T:
    """``cast(value)`` of variable ``var`` (unset or empty: ``default``); a bad value is a ConfigError."""
    raw = (os.environ if env is None else env).get(var, "")
    if raw == "":
        return default
    try:
        value = cast(raw)
    except ValueError:
        kind = getattr(cast, "__name__", "value")
        raise ConfigError(f"{var.value}={raw!r} is not a valid {kind}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{var.value}={raw!r} must be finite")
    return value

"""Settings a worker receives: environment (set by the supervisor) over ``init()`` keywords over defaults.

The supervisor's CLI flags travel as ``GPUFLEET_*`` variables, so ``gpufleet run --checkpoint-every 50``
overrides what the script passed to ``gpufleet.init``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from gpufleet.core.errors import ConfigError

__all__ = ["RunSettings", "ENV"]

# field name -> environment variable
ENV = {
    "run_dir": "GPUFLEET_RUN_DIR",
    "checkpoint_every": "GPUFLEET_CKPT_EVERY",
    "checkpoint_dir": "GPUFLEET_CKPT_DIR",
    "keep_last": "GPUFLEET_KEEP_LAST",
    "upload_url": "GPUFLEET_UPLOAD",
    "s3_endpoint": "GPUFLEET_S3_ENDPOINT",
    "mtbf_s": "GPUFLEET_MTBF",
    "spike_window": "GPUFLEET_SPIKE_WINDOW",
    "spike_threshold": "GPUFLEET_SPIKE_THRESHOLD",
    "overlap_staging": "GPUFLEET_OVERLAP",
}


@dataclass
class RunSettings:
    run_dir: str = "runs/default"
    checkpoint_every: str = "auto"  # "N" / "Nsteps" / "90s" / "auto" (Young/Daly)
    checkpoint_dir: str | None = None  # default RUN_DIR/checkpoints
    keep_last: int = 3
    upload_url: str | None = None  # s3://bucket/prefix for tiered copies
    s3_endpoint: str | None = None
    mtbf_s: float | None = None  # configured MTBF for `auto` before the ledger has failures
    spike_window: int = 50
    spike_threshold: float = 8.0
    overlap_staging: bool = True  # copy params/optimizer state during the next forward/backward
    # Set by the supervisor only:
    control_fd: int | None = None
    attempt: int = 0
    session: str | None = None
    faults: str | None = None
    rollback: dict[str, Any] = field(default_factory=dict)  # {"max_step": int, "skip": [[a, b], ...]}

    def __post_init__(self) -> None:
        if self.keep_last < 1:
            raise ConfigError("keep_last must be >= 1")
        if self.spike_window < 3:
            raise ConfigError("spike_window must be >= 3")
        if self.mtbf_s is not None and self.mtbf_s <= 0:
            raise ConfigError("mtbf_s must be > 0")
        if self.upload_url is not None and not self.upload_url.startswith("s3://"):
            raise ConfigError(f"upload url must look like s3://bucket/prefix, got {self.upload_url!r}")

    @property
    def ckpt_dir(self) -> Path:
        return Path(self.checkpoint_dir) if self.checkpoint_dir else Path(self.run_dir) / "checkpoints"

    @classmethod
    def load(cls, **kwargs: Any) -> RunSettings:
        """Defaults <- ``init()`` keywords <- environment."""
        known = {f.name: f for f in fields(cls)}
        for k in kwargs:
            if k not in known:
                raise ConfigError(f"unknown gpufleet.init() option {k!r}; valid: {', '.join(ENV)}")
        values: dict[str, Any] = dict(kwargs)
        for name, var in ENV.items():
            raw = os.environ.get(var)
            if raw is None or raw == "":
                continue
            typ = known[name].type
            try:
                if name in ("keep_last", "spike_window"):
                    values[name] = int(raw)
                elif name in ("mtbf_s", "spike_threshold"):
                    values[name] = float(raw)
                elif name == "overlap_staging":
                    values[name] = raw not in ("0", "false", "no")
                else:
                    values[name] = raw
            except ValueError:
                raise ConfigError(f"{var}={raw!r} is not a valid {typ}") from None
        if os.environ.get("GPUFLEET_CONTROL_FD"):
            values["control_fd"] = int(os.environ["GPUFLEET_CONTROL_FD"])
        values["attempt"] = int(os.environ.get("GPUFLEET_ATTEMPT", "0"))
        values["session"] = os.environ.get("GPUFLEET_SESSION")
        values["faults"] = os.environ.get("GPUFLEET_FAULTS")
        if os.environ.get("GPUFLEET_ROLLBACK"):
            values["rollback"] = json.loads(os.environ["GPUFLEET_ROLLBACK"])
        return cls(**values)

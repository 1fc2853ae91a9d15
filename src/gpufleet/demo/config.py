"""The demo's records: its configuration and what each run and the whole demo produced.

Shared by :mod:`gpufleet.demo.runner` (which runs the demo) and :mod:`gpufleet.demo.render` (which
prints it), so that neither imports the other's module for its types.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpufleet.core.errors import UsageError

__all__ = ["CONFIG_NAME", "DemoConfig", "DemoResult", "RunTiming"]

CONFIG_NAME = "demo_config.json"


@dataclass
class DemoConfig:
    dir: Path = Path("runs/demo")
    steps: int = 400
    nproc: int = 2
    seed: int = 1234
    reference: bool = True
    checkpoint_every: int = 25
    hang_timeout_floor: float = 3.0
    max_restarts: int = 8
    progress: bool = True
    plot: bool = True
    in_process: bool = True  # the faulted run recovers crashes and hangs in-process where it is safe
    extra_args: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.dir = Path(self.dir)
        if self.nproc < 1:
            raise UsageError("--nproc must be >= 1")
        if self.checkpoint_every < 2:
            raise UsageError("checkpoint interval must be >= 2 steps")
        if self.steps < 8 * self.checkpoint_every:
            raise UsageError(
                f"--steps must be >= {8 * self.checkpoint_every} so the faults land between checkpoints"
            )

    def identity(self) -> dict[str, Any]:
        """What must match for two runs to be comparable bit for bit."""
        return {"steps": self.steps, "nproc": self.nproc, "seed": self.seed, "extra_args": self.extra_args}


@dataclass
class RunTiming:
    name: str
    run_dir: Path
    status: str
    exit_code: int
    restarts: int
    wall_s: float


@dataclass
class DemoResult:
    reference: RunTiming | None
    faulted: RunTiming
    injected: list[str]
    identical: bool | None  # None when there was no reference to compare with
    comparison: dict[str, Any] | None
    timeline: Path | None
    exit_code: int

"""The supervisor's configuration (``gpufleet run``'s flags, typed), validated before anything launches.

The worker settings it passes on (``--checkpoint-every``, ``--keep-last``, ``--upload``,
``--s3-endpoint``, ``--mtbf``) are validated by the workers' own model,
:class:`gpufleet.core.settings.RunSettings`, layered over this process's environment exactly as a
worker will see them. So a value a worker would reject fails here, as one line naming the flag.

This lives in ``train/`` beside the supervisor rather than in ``core/settings.py`` because it parses
fault drills (``train.faults``) and describes a supervisor; ``core`` holds only what every layer may
read (the variable table and the worker contract).
"""

from __future__ import annotations

import shutil
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from gpufleet.core.errors import ConfigError
from gpufleet.core.settings import SETTING_FLAG, RunSettings, validation_message
from gpufleet.train.faults import Fault, parse_faults

__all__ = ["SupervisorConfig", "FLAGS", "MAX_NPROC"]

MAX_NPROC = 1024
"""The most worker processes one node runs (``--nproc-per-node``)."""

# SupervisorConfig field -> the `gpufleet run` flag that sets it (errors name the flag)
FLAGS: dict[str, str] = {
    "nproc": "--nproc-per-node",
    "run_dir": "--run-dir",
    "backend": "--backend",
    "max_restarts": "--max-restarts",
    "restart_window": "--restart-window",
    "max_no_progress": "--max-no-progress",
    "max_rollbacks": "--max-rollbacks",
    "rollback_window": "--rollback-window",
    "inject": "--inject",
    "hang_timeout_floor": "--hang-timeout",
    "init_timeout": "--init-timeout",
    "cpu_affinity": "--cpu-affinity",
    "min_nproc": "--min-nproc",
    "slot_failures": "--slot-failures",
    "in_process_restart": "--in-process-restart",
    "straggler_action": "--straggler-action",
    "master_addr": "--master-addr",
    "master_port": "--master-port",
    "rdzv_id": "--rdzv-id",
    "env": "--env",
    "auto_telemetry": "--auto-telemetry",
    **SETTING_FLAG,
}
_WORKER_FIELDS = (
    "checkpoint_every",
    "keep_last",
    "upload_url",
    "s3_endpoint",
    "mtbf_s",
    "memory_tier",
    "dist_backend",
)


class SupervisorConfig(BaseModel):
    """What ``gpufleet run`` was asked to do. Validates itself: a bad value is a one-line ConfigError."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    command: list[str] = Field(min_length=1)
    nproc: int = Field(1, ge=1, le=MAX_NPROC)
    run_dir: str = Field("runs/default", min_length=1)
    backend: str = "local"
    max_restarts: int = Field(10, ge=0)  # within any `restart_window` steps: a rate
    restart_window: int = Field(1000, ge=0)  # steps; 0: count over the whole run
    max_no_progress: int = Field(3, ge=0)  # consecutive restarts without a newer committed checkpoint
    max_rollbacks: int = Field(3, ge=0)  # within any `rollback_window` steps: a rate
    rollback_window: int = Field(1000, ge=0)  # steps; 0: count over the whole run
    inject: list[str] = Field(default_factory=list)
    hang_timeout_floor: float = Field(60.0, gt=0)
    init_timeout: float = Field(300.0, gt=0)
    grace_s: float = Field(5.0, ge=0)
    final_grace_s: float = Field(120.0, ge=0)
    # Worker settings passed on as GPUFLEET_* variables (None: the worker's own value stands).
    checkpoint_every: str | None = None
    keep_last: int | None = None
    upload_url: str | None = None
    s3_endpoint: str | None = None
    mtbf_s: float | None = None
    memory_tier: str | None = None  # in-memory checkpoint tier budget ("2GiB"; "0": off)
    dist_backend: str | None = None  # auto, nccl, gloo (checked by the workers' RunSettings)
    standby: bool = True
    auto_telemetry: bool = True  # ranks report optimizer steps without gpufleet.init() (train/autostep.py)
    progress: bool = False
    poll_s: float = Field(0.02, gt=0)
    backend_options: dict[str, Any] = Field(default_factory=dict)  # e.g. srun: nodes, min_nodes
    # Worker resources (backends.resources): threads default to each rank's share of the CPUs.
    cpu_affinity: str = "none"  # none, auto, numa, or per-rank CPU lists (0-3:4-7)
    min_nproc: int | None = Field(None, ge=1)  # local: continue with fewer ranks, down to this
    slot_failures: int = Field(2, ge=1)  # local, with min_nproc: failures in a row that drop a slot
    in_process_restart: bool = False  # local: survivors of a crash or hang rejoin in their own process
    straggler_action: Literal["record", "restart"] = "record"  # restart: a persistent straggler is a failure
    # torchrun's launch line (cli/run.py checks the combinations): the rendezvous address and port
    # (None: the backend's choice) and TORCHELASTIC_RUN_ID (None: the run's session).
    master_addr: str | None = Field(None, min_length=1)
    master_port: int | None = Field(None, ge=1, le=65535)
    rdzv_id: str | None = None
    # --env / --env-file: variables every rank gets (backends.environ). Left out of public(): the
    # ledger's run_start never holds their values, which may be credentials.
    env: dict[str, str] = Field(default_factory=dict, exclude=True)

    _faults: list[Fault] = PrivateAttr(default_factory=list)
    _worker: RunSettings = PrivateAttr()

    def __init__(self, **data: Any) -> None:
        if not data.get("command"):
            raise ConfigError("no training command given; usage: gpufleet run [OPTIONS] -- python train.py")
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise ConfigError(validation_message(e, FLAGS, data)) from None

    @field_validator("checkpoint_every", mode="before")
    @classmethod
    def _interval_text(cls, v: Any) -> Any:
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else v

    @model_validator(mode="after")
    def _check_workers(self) -> SupervisorConfig:
        # Both raise ConfigError/UsageError (not ValueError), which pydantic lets through unchanged.
        self._faults = parse_faults(self.inject)
        self._check_fault_ranks()
        self._worker = RunSettings.for_workers(self.worker_overrides())
        self._check_resources()
        return self

    def _check_fault_ranks(self) -> None:
        """A drill aimed at a rank the run does not have would never fire: refuse it before launch."""
        nodes = self.backend_options.get("nodes") or 1
        world = self.nproc * nodes
        for f in self._faults:
            if f.rank is not None and not 0 <= f.rank < world:
                raise ConfigError(
                    f"--inject {f.spec}: rank {f.rank} is not in this run of {world} rank(s) (0-{world - 1})"
                )

    def _check_resources(self) -> None:
        from gpufleet.backends.resources import (
            dist_plan,
            host_plan,
            parse_cpu_affinity,
            visible_gpus,
        )

        affinity = parse_cpu_affinity(self.cpu_affinity, self.nproc)
        self.cpu_affinity = str(affinity)
        if self.backend == "local":
            if shutil.which(self.command[0]) is None:
                raise ConfigError(f"{self.command[0]}: command not found (or not executable)")
            host_plan(self.nproc, affinity)  # explicit CPUs must exist here (ConfigError names them)
            # The last local rank's plan, as its worker will make it: refuse before launching, not at
            # that rank's init (NCCL needs a GPU per rank; --dist-backend nccl needs a GPU at all).
            dist_plan(self._worker.dist_backend, self.nproc - 1, visible_gpus())
        if self.min_nproc is not None:
            if self.backend != "local":
                raise ConfigError("--min-nproc is for the local backend (srun/slurm: --min-nodes)")
            if self.min_nproc > self.nproc:
                raise ConfigError(f"--min-nproc {self.min_nproc} is more than --nproc-per-node {self.nproc}")
        if self.in_process_restart:
            from gpufleet.backends.local import python_entry

            if self.backend != "local":
                raise ConfigError(
                    f"--in-process-restart is for the local backend; the {self.backend} backend restarts "
                    "whole attempts"
                )
            if python_entry(self.command) is None:
                raise ConfigError(
                    "--in-process-restart needs a command of the form `python SCRIPT ...` or "
                    "`python -m MODULE ...` (the harness runs it in the worker's own interpreter)"
                )

    def backend_kwargs(self) -> dict[str, Any]:
        """The options the chosen backend is built with (besides ``standby``)."""
        out = dict(self.backend_options)
        if self.backend == "local" and self.min_nproc is not None:
            out.update(min_nproc=self.min_nproc, slot_failures=self.slot_failures)
        if self.backend == "local" and self.in_process_restart:
            out.update(in_process=True)
        return out

    @property
    def faults(self) -> list[Fault]:
        """The parsed ``--inject`` drills."""
        return list(self._faults)

    @property
    def worker(self) -> RunSettings:
        """The settings every worker will start from (before its ``init()`` keywords)."""
        return self._worker

    def worker_overrides(self) -> dict[str, Any]:
        """The worker settings this config sets (field -> value)."""
        return {k: getattr(self, k) for k in _WORKER_FIELDS if getattr(self, k) is not None}

    def worker_env(self) -> dict[str, str]:
        """``GPUFLEET_*`` variables that carry :meth:`worker_overrides` to the workers."""
        return RunSettings.to_env(self.worker_overrides())

    def public(self) -> dict[str, Any]:
        """The config as the ledger's ``run_start`` event records it."""
        return self.model_dump(mode="json")

"""gpufleet: keep every GPU in a fleet doing useful work.

The public API for training scripts is small and cheap to import::

    import gpufleet
    run = gpufleet.init()
    start = run.restore({"model": model, "optim": optim})
    for step in run.steps(total):
        ...
        run.log(loss=loss)

A script that does not call ``init()`` is still watched under ``gpufleet run``: each optimizer step
is reported on its own (docs/telemetry.md); ``gpufleet.step()`` reports a step without an optimizer.

torch is imported only when ``init()`` is called: ``import gpufleet`` loads the standard library
and ``gpufleet.core.errors``, nothing else. ``Run`` and the training helpers are resolved on first
use (module ``__getattr__``); ``__all__`` lists the whole public API.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpufleet.core.errors import (
    CheckpointCorrupt,
    CheckpointError,
    ConfigError,
    GpufleetError,
    NoCheckpoint,
    RetryableStorageError,
    StorageError,
    SupervisorError,
    TerminalStorageError,
    UsageError,
)

if TYPE_CHECKING:
    from gpufleet.train.run import Run
    from gpufleet.train.state import EarlyStopping, RNGState, StepSampler

__version__ = "0.1.0"

__all__ = [
    "init",
    "step",
    "Run",
    "EarlyStopping",
    "RNGState",
    "StepSampler",
    "resumable",
    "ResumableLoader",
    "GpufleetError",
    "UsageError",
    "ConfigError",
    "CheckpointError",
    "CheckpointCorrupt",
    "NoCheckpoint",
    "StorageError",
    "RetryableStorageError",
    "TerminalStorageError",
    "SupervisorError",
    "__version__",
]


def init(**kwargs: Any) -> Run:
    """Join the supervised run (or start a standalone one) and set up torch.distributed.

    See :class:`gpufleet.train.run.Run` for the keyword arguments.
    """
    from gpufleet.train.run import init as _init

    return _init(**kwargs)


def step(step: int | None = None) -> None:
    """Say that a training step has finished, in a script that does not call :func:`init`.

    Under ``gpufleet run`` each call is a step heartbeat (and, on rank 0, a ``step`` event), so a
    script that trains without a torch optimizer is watched for hangs and counted in the report.
    ``step``: the finished step's 0-based index (default: the one after the last). A no-op outside
    ``gpufleet run`` and in a script that called :func:`init` (its :class:`Run` reports the steps).
    """
    from gpufleet.train.autostep import mark_step

    mark_step(step)


def __getattr__(name: str) -> Any:
    # Lazy re-exports: these pull in torch, which a bare `import gpufleet` must not.
    if name == "Run":
        from gpufleet.train.run import Run

        return Run
    if name in ("resumable", "ResumableLoader"):
        from gpufleet.train import data

        return getattr(data, name)
    if name in ("EarlyStopping", "RNGState", "StepSampler"):
        from gpufleet.train import state

        return getattr(state, name)
    raise AttributeError(f"module 'gpufleet' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

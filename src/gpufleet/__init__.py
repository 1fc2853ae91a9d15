"""gpufleet: keep every GPU in a fleet doing useful work.

The public API for training scripts is small and cheap to import::

    import gpufleet
    run = gpufleet.init()
    start = run.restore({"model": model, "optim": optim})
    for step in run.steps(total):
        ...
        run.log(loss=loss)

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

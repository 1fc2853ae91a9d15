"""gpufleet's run API inside a Ray Train ``TorchTrainer`` loop, for users who keep Ray Train.

Ray Train keeps scheduling, the worker group, torch.distributed and ``FailureConfig(max_failures)``;
gpufleet adds verified checkpoints with exact resume, and the loss-spike/NaN guard::

    import gpufleet.ray

    def train_loop(config):
        run = gpufleet.ray.init(run_dir=config["run_dir"])  # a directory every Ray node sees
        start = run.restore({"model": model, "optim": optim, "rng": gpufleet.RNGState()})
        for step in run.steps(1000):
            ...
            run.log(loss=loss)              # raises gpufleet.ray.SpikeDetected on a spike or NaN
            gpufleet.ray.report(run, loss=loss.item())
        run.finish()

    TorchTrainer(train_loop, scaling_config=ScalingConfig(num_workers=2),
                 run_config=RunConfig(failure_config=FailureConfig(max_failures=3))).fit()

When a worker dies, Ray Train restarts the group and ``run.restore`` resumes every rank from the newest
*verified* gpufleet checkpoint, at the exact sample (``StepSampler``). A spike raises
:class:`SpikeDetected` on every rank (the loss is agreed across ranks first); Ray Train counts it as a
worker-group failure and retries within ``max_failures``. Unlike ``gpufleet run``, nothing here skips
the offending batch on the retry (that needs gpufleet's supervisor: ``gpufleet run --backend ray``),
and a checkpoint still persisting when the group fails may be lost with it (the retry then resumes
from the verified one before). tests/integration/test_ray_backend.py runs both failures in one fit.
Ray is imported lazily (the ``ray`` extra).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from gpufleet.core.env import Env
from gpufleet.core.errors import UsageError
from gpufleet.core.launch import LaunchEnv

if TYPE_CHECKING:
    from gpufleet.train.run import Run, SpikeDetected  # noqa: F401 (SpikeDetected: resolved lazily)

__all__ = ["init", "report", "SpikeDetected"]


def __getattr__(name: str) -> Any:
    if name == "SpikeDetected":
        from gpufleet.train.run import SpikeDetected

        return SpikeDetected
    raise AttributeError(name)


def init(**kwargs: Any) -> Run:
    """:func:`gpufleet.init` for a Ray Train worker: rank and world from Ray Train's context.

    Ray Train has set torch.distributed up already; gpufleet uses that process group. ``run_dir``
    (or ``$GPUFLEET_RUN_DIR``) must be a directory all Ray nodes share, or set ``upload_url``.
    """
    try:
        import ray.train
    except ImportError:
        raise UsageError("gpufleet.ray needs Ray Train: pip install 'gpufleet[ray]'") from None
    ctx = ray.train.get_context()
    place = LaunchEnv(
        rank=ctx.get_world_rank(),
        world_size=ctx.get_world_size(),
        local_rank=ctx.get_local_rank(),
        local_world_size=ctx.get_local_world_size(),
    )
    os.environ.update(place.to_environ())
    if "run_dir" not in kwargs and not Env.RUN_DIR.get():
        raise UsageError("gpufleet.ray.init(run_dir=...): a directory every Ray node shares")
    import signal
    import threading

    import gpufleet

    if threading.current_thread() is threading.main_thread():
        return gpufleet.init(**kwargs)
    # Ray Train runs the loop in a thread, where Python refuses signal handlers. The run's SIGUSR1
    # handler (the supervisor's final-checkpoint request) has no use under Ray Train: skip installing it.
    real = signal.signal
    signal.signal = lambda signum, handler: signal.getsignal(signum)  # type: ignore[assignment]
    try:
        return gpufleet.init(**kwargs)
    finally:
        signal.signal = real


def report(run: Run, **metrics: Any) -> None:
    """``ray.train.report`` the metrics and gpufleet's step.

    Checkpoints stay in gpufleet's run directory (Ray does not copy them): resume is ``run.restore``'s,
    not Ray Train's checkpointing.
    """
    import ray.train

    ray.train.report({**metrics, "gpufleet_step": run.step})

"""Where worker processes run. A backend is a few small hooks; see :class:`gpufleet.backends.base.Backend`."""

from __future__ import annotations

from gpufleet.backends.base import Backend, LaunchSpec, Worker
from gpufleet.core.errors import UsageError

__all__ = ["Backend", "LaunchSpec", "Worker", "get_backend", "BACKENDS"]

BACKENDS = ("local", "srun", "slurm")  # slurm: `gpufleet run` submits a batch job running srun


def get_backend(name: str, **options: object) -> Backend:
    """Look a backend up by name; the error lists the valid choices."""
    if name == "local":
        from gpufleet.backends.local import LocalBackend

        return LocalBackend(**options)  # type: ignore[arg-type]
    if name == "srun":
        from gpufleet.backends.srun import SrunBackend

        return SrunBackend(**options)  # type: ignore[arg-type]
    if name == "slurm":
        raise UsageError("the slurm backend submits a batch job: use `gpufleet run --backend slurm ...`")
    raise UsageError(f"unknown backend {name!r}; valid backends: {', '.join(BACKENDS)}")

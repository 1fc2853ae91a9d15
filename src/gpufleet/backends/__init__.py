"""Where worker processes run. A backend is a few small hooks; see :class:`gpufleet.backends.base.Backend`.

The registry below maps a name to the class :func:`get_backend` returns; a new backend is one line.
Slurm batch submission (:mod:`gpufleet.backends.slurm`) is not in it: it runs the supervisor itself
inside a batch job, where that supervisor uses the ``srun`` backend.
"""

from __future__ import annotations

from importlib import import_module

from gpufleet.backends.base import (
    CONTINUE,
    Attempt,
    Backend,
    Blame,
    EventChannel,
    LaunchSpec,
    Verdict,
    Worker,
)
from gpufleet.core.errors import UsageError

__all__ = [
    "Attempt", "Backend", "Blame", "CONTINUE", "EventChannel", "LaunchSpec", "Verdict", "Worker",
    "backend_class", "get_backend", "BACKENDS",
]

_REGISTRY = {  # name -> "module:class", imported only when asked for
    "local": "gpufleet.backends.local:LocalBackend",
    "srun": "gpufleet.backends.srun:SrunBackend",
    "ray": "gpufleet.backends.ray:RayBackend",
    "k8s-jobs": "gpufleet.backends.k8s:K8sJobsBackend",  # the supervisor inside a Kubernetes pod
}
BACKENDS = tuple(_REGISTRY)


def backend_class(name: str) -> type[Backend]:
    """The class registered as ``name``; the error lists the valid choices."""
    target = _REGISTRY.get(name)
    if target is None:
        hint = " (slurm submits a batch job: `gpufleet run --backend slurm`)" if name == "slurm" else ""
        raise UsageError(f"unknown backend {name!r}{hint}; valid backends: {', '.join(BACKENDS)}")
    module, cls = target.split(":")
    found: type[Backend] = getattr(import_module(module), cls)
    return found


def get_backend(name: str, **options: object) -> Backend:
    """A backend by name, built with ``options``; the error lists the valid choices."""
    return backend_class(name)(**options)

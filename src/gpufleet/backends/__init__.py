"""Where worker processes run. A backend is a few small hooks; see :class:`gpufleet.backends.base.Backend`.

The registries below map a name to a class, imported only when asked for; a new backend is one line.
:data:`BACKENDS` run the workers (:func:`get_backend`). :data:`SUBMITTERS` write a batch job whose
supervisor runs ``gpufleet run`` again inside it, on their ``inner`` backend (:func:`submitter_class`):
Slurm (``srun`` inside) and Kubernetes (``k8s-jobs`` inside). Each platform is one subpackage:
:mod:`.slurm`, :mod:`.k8s`, :mod:`.ray`.
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
    Submitter,
    Verdict,
    Worker,
)
from gpufleet.core.errors import UsageError

__all__ = [
    "Attempt",
    "Backend",
    "Blame",
    "CONTINUE",
    "EventChannel",
    "LaunchSpec",
    "Submitter",
    "Verdict",
    "Worker",
    "backend_class",
    "get_backend",
    "submitter_class",
    "BACKENDS",
    "SUBMITTERS",
    "RUN_BACKENDS",
]

_REGISTRY = {  # name -> "module:class", imported only when asked for
    "local": "gpufleet.backends.local:LocalBackend",
    "srun": "gpufleet.backends.slurm.srun:SrunBackend",
    "ray": "gpufleet.backends.ray.backend:RayBackend",
    "k8s-jobs": "gpufleet.backends.k8s.backend:K8sJobsBackend",  # the supervisor inside a Kubernetes pod
}
_SUBMITTERS = {  # name -> "module:class" of a batch submission
    "slurm": "gpufleet.backends.slurm.sbatch:SlurmSubmitter",
    "k8s": "gpufleet.backends.k8s.backend:K8sSubmitter",
}
BACKENDS = tuple(_REGISTRY)
SUBMITTERS = tuple(_SUBMITTERS)
RUN_BACKENDS = (*BACKENDS, *SUBMITTERS)
"""Every value of ``gpufleet run --backend``."""


def _load(target: str) -> type:
    module, cls = target.split(":")
    found: type = getattr(import_module(module), cls)
    return found


def backend_class(name: str) -> type[Backend]:
    """The class registered as ``name``; the error lists the valid choices."""
    target = _REGISTRY.get(name)
    if target is None:
        batch = name in _SUBMITTERS
        hint = f" ({name} submits a batch job: `gpufleet run --backend {name}`)" if batch else ""
        raise UsageError(f"unknown backend {name!r}{hint}; valid backends: {', '.join(BACKENDS)}")
    found: type[Backend] = _load(target)
    return found


def submitter_class(name: str) -> type[Submitter]:
    """The batch submission registered as ``name``; the error lists every ``--backend`` choice."""
    target = _SUBMITTERS.get(name)
    if target is None:
        raise UsageError(f"--backend {name!r} is not a backend; valid backends: {', '.join(RUN_BACKENDS)}")
    found: type[Submitter] = _load(target)
    return found


def get_backend(name: str, **options: object) -> Backend:
    """A backend by name, built with ``options``; the error lists the valid choices."""
    return backend_class(name)(**options)

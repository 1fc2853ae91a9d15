"""Kubernetes: the manifests ``gpufleet run --backend k8s`` writes, and health actions on nodes.

- :mod:`gpufleet.k8s.manifests`: pure builders (dicts) for the run's objects: the supervisor Job and its
  RBAC, the per-attempt indexed worker Job, the headless Service for torch rendezvous, the
  PodDisruptionBudget, the `gpufleet health watch` DaemonSet and the node-problem-detector plugin.
- :mod:`gpufleet.k8s.actions`: cordon and taint a failing node with an owned reason, never undo an
  administrator's cordon, behind the same circuit breaker as Slurm drains; through the official
  ``kubernetes`` client (the ``k8s`` extra), imported lazily.

No live cluster was used to build or test this package (docs/backends/k8s.md says what was run).
"""

from __future__ import annotations

__all__: list[str] = []

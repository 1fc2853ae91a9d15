"""Kubernetes: submitting a run, the supervisor inside the cluster, its pods' agent, node actions.

- :mod:`.backend`: ``gpufleet run --backend k8s`` (:class:`~.backend.K8sSubmitter` writes and applies
  the manifests) and ``k8s-jobs`` (:class:`~.backend.K8sJobsBackend`, the supervisor in its pod: one
  indexed Job per attempt).
- :mod:`.agent`: the worker pod's entry (``python -m gpufleet.backends.k8s``) and its preStop hook.
- :mod:`.manifests`: pure builders (dicts) for the run's objects: the supervisor Job and its RBAC, the
  per-attempt indexed worker Job, the headless Service for torch rendezvous, the PodDisruptionBudget,
  the ``gpufleet health watch`` DaemonSet and the node-problem-detector plugin.
- :mod:`.actions`: isolate (cordon and taint with an owned reason) and release a node, behind the one
  circuit breaker of :mod:`gpufleet.health.actions`; through the official ``kubernetes`` client
  (the ``k8s`` extra), imported lazily.

Its tests drive it against a fake API server at the HTTP boundary (tests/integration/k8s_fake.py);
docs/backends/k8s.md says what that covers and what only a real cluster can show.
"""

from __future__ import annotations

__all__: list[str] = []

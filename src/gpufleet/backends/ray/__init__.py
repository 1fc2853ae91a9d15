"""Ray: the backend, its node agent, and node health with quarantine.

- :mod:`.backend`: ``gpufleet run --backend ray`` (:class:`~.backend.RayBackend`): a placement group per
  attempt, one :class:`~.backend.NodeAgent` actor per Ray node.
- :mod:`.agent`: the node agent process the actor starts (``python -m gpufleet.backends.ray``).
- :mod:`.quarantine`: ``gpufleet health check`` as one Ray task per node, and the Ray side of the node
  actions: isolate (quarantine: hold the node's ``gpufleet`` resource) and release.

Ray Train's ``TorchTrainer`` loop uses the public API through :mod:`gpufleet.ray` instead (layer 3:
it calls :func:`gpufleet.init`). Ray is imported lazily (the ``ray`` extra).
"""

from __future__ import annotations

__all__: list[str] = []

"""Slurm: batch submission, the srun backend inside the allocation, and node actions.

- :mod:`.sbatch`: ``gpufleet run --backend slurm`` (:class:`~.sbatch.SlurmSubmitter`) writes a readable
  sbatch script and submits it; the supervisor inside runs on the srun backend.
- :mod:`.srun`: the srun backend (:class:`~.srun.SrunBackend`): one node agent
  (:mod:`gpufleet.backends.agent`) per node through ``srun``, node-loss detection, spares.
- :mod:`.actions`: the Slurm side of the node actions: isolate (drain with an owned reason) and release
  (resume), behind the one circuit breaker of :mod:`gpufleet.health.actions`; and the body of the
  HealthCheckProgram that ``gpufleet health slurm-config`` writes
  (``python -m gpufleet.backends.slurm healthcheck NODE -- CHECK ...``).
"""

from __future__ import annotations

__all__: list[str] = []

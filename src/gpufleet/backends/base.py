"""The backend interface: how the supervisor starts and stops one attempt's workers.

A backend answers three questions — start these ranks, which of them have exited, stop them — and
nothing else: restart policy, hang detection and the ledger stay in the supervisor, so Slurm,
Kubernetes and Ray backends reuse them. Multi-node rendezvous travels in :class:`LaunchSpec`
(``master_addr``/``master_port``, ``nnodes``/``node_rank``): each node's agent starts its local ranks.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["LaunchSpec", "Worker", "Backend"]


@dataclass
class LaunchSpec:
    command: list[str]
    nproc_per_node: int
    env: dict[str, str] = field(default_factory=dict)  # GPUFLEET_* settings shared by all ranks
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    attempt: int = 0
    log_dir: str | None = None  # worker stdout/stderr go to LOG_DIR/attempt-A/rank-R.log (else inherited)

    def log_path(self, rank: int) -> str | None:
        if self.log_dir is None:
            return None
        return os.path.join(self.log_dir, f"attempt-{self.attempt}", f"rank-{rank}.log")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def rank_env(self, local_rank: int) -> dict[str, str]:
        rank = self.node_rank * self.nproc_per_node + local_rank
        return {
            "RANK": str(rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.nproc_per_node),
            "GROUP_RANK": str(self.node_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "GPUFLEET_ATTEMPT": str(self.attempt),
        }


@dataclass
class Worker:
    rank: int
    proc: subprocess.Popen[bytes]
    control_fd: int  # read end of the worker's event pipe, owned by the supervisor

    @property
    def pid(self) -> int:
        return self.proc.pid


class Backend(Protocol):
    name: str

    def prepare(self, spec: LaunchSpec) -> None:
        """Optional warm-up before a failure happens (e.g. pre-spawn standby interpreters)."""

    def start(self, spec: LaunchSpec) -> list[Worker]:
        """Start this node's ranks for one attempt."""

    def stop(self, workers: list[Worker], grace_s: float) -> None:
        """SIGTERM the workers (and their children), SIGKILL what is left after ``grace_s``."""

    def close(self) -> None:
        """Release anything prepared but unused."""

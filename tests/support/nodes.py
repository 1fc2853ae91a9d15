"""Simulated nodes on one host for multi-node gloo jobs: each node's ranks get the environment a
2-node torchrun/srun job gives them (``RANK``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
``NODE_RANK``) and a node of their own for the in-memory tier (``GPUFLEET_MEMORY_TIER_DIR`` =
``shm/node<N>``, standing for that node's /dev/shm). A lost node: its ranks killed, its directory
removed."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from gpufleet.core.ports import free_port
from support.process import child_env, is_alive

__all__ = ["NodeJob"]


@dataclass
class NodeJob:
    """``nodes`` x ``per_node`` ranks of ``argv`` (after the interpreter), started by :meth:`start`."""

    shm: Path
    nodes: int = 2
    per_node: int = 1
    env: dict[str, str] = field(default_factory=dict)
    procs: list[subprocess.Popen[str]] = field(default_factory=list)

    def node_dir(self, node: int) -> Path:
        return self.shm / f"node{node}"

    def start(self, argv: list[str], extra: dict[int, list[str]] | None = None) -> NodeJob:
        """Start every rank; ``extra``: more arguments for some ranks (by rank)."""
        port = free_port()
        world = self.nodes * self.per_node
        self.procs = []
        for rank in range(world):
            node, local = divmod(rank, self.per_node)
            env = {
                **child_env(),
                **self.env,
                "RANK": str(rank),
                "LOCAL_RANK": str(local),
                "WORLD_SIZE": str(world),
                "LOCAL_WORLD_SIZE": str(self.per_node),
                "GROUP_RANK": str(node),
                "NODE_RANK": str(node),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "GPUFLEET_MEMORY_TIER_DIR": str(self.node_dir(node)),
                "OMP_NUM_THREADS": "1",
            }
            cmd = [sys.executable, *argv, *(extra or {}).get(rank, [])]
            self.procs.append(
                subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            )
        return self

    def wait(self, timeout: float = 120) -> list[tuple[int, str, str]]:
        """(exit code, stdout, stderr) of every rank."""
        out = []
        try:
            for p in self.procs:
                so, se = p.communicate(timeout=timeout)
                out.append((p.returncode, so, se))
        finally:
            self.kill()
        return out

    def kill(self, node: int | None = None) -> None:
        """SIGKILL every rank (of ``node``) still running, and reap it."""
        for rank, p in enumerate(self.procs):
            if node is None or rank // self.per_node == node:
                if p.poll() is None and is_alive(p.pid):
                    os.kill(p.pid, signal.SIGKILL)
                p.wait()

    def lose(self, node: int) -> None:
        """The node is gone: its ranks killed, its memory (keeper directory) with them."""
        self.kill(node)
        shutil.rmtree(self.node_dir(node), ignore_errors=True)

    def wait_exit(self, rank: int, timeout: float = 120) -> int:
        """Wait for one rank to exit (e.g. a kill drill's victim); its exit code."""
        return self.procs[rank].wait(timeout=timeout)

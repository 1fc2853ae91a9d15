"""Where this process sits in a distributed launch: :class:`LaunchEnv`, read once from torchrun's
variables (which every gpufleet backend sets for its ranks) and written back for a child the same way.

The node's name is worked out here, and only here: ``GPUFLEET_NODE`` (set by the Kubernetes and Ray
backends), else ``SLURMD_NODENAME`` (Slurm), else the short hostname.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass

from gpufleet.core.env import Env, Platform

__all__ = ["LaunchEnv", "node_name"]


def node_name(env: Mapping[str, str] | None = None) -> str:
    """This node's name: ``GPUFLEET_NODE``, else ``SLURMD_NODENAME``, else the short hostname."""
    return Env.NODE.get(env) or Platform.SLURMD_NODENAME.get(env) or socket.gethostname().split(".")[0]


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchEnv:
    """A rank's place in its job. Without a launcher (a plain ``python train.py``): rank 0 of 1."""

    rank: int = 0
    """This process's rank (``RANK``)."""
    world_size: int = 1
    """Ranks in the job (``WORLD_SIZE``)."""
    local_rank: int = 0
    """Its rank on its node (``LOCAL_RANK``; unset: ``rank``)."""
    local_world_size: int = 1
    """Ranks on its node (``LOCAL_WORLD_SIZE``; unset or not positive: ``world_size``)."""
    node: str = ""
    """Its node's name (:func:`node_name`)."""

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> LaunchEnv:
        """The launch ``env`` (default ``os.environ``) describes; a malformed number is a ConfigError."""
        rank = Platform.RANK.get(env)
        world = Platform.WORLD_SIZE.get(env)
        local = Platform.LOCAL_RANK.get(env)
        local_world = Platform.LOCAL_WORLD_SIZE.get(env)
        return cls(
            rank=rank,
            world_size=world,
            local_rank=rank if local is None else local,
            local_world_size=world if local_world is None or local_world < 1 else local_world,
            node=node_name(env),
        )

    def to_environ(self) -> dict[str, str]:
        """The variables that describe this place to a child process (the node's name is its own)."""
        return {
            Platform.RANK: Platform.RANK.format(self.rank),
            Platform.WORLD_SIZE: Platform.WORLD_SIZE.format(self.world_size),
            Platform.LOCAL_RANK: str(self.local_rank),
            Platform.LOCAL_WORLD_SIZE: str(self.local_world_size),
        }

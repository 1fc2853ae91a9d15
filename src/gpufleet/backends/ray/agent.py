"""The Ray backend's node agent process, ``python -m gpufleet.backends.ray``.

A :class:`~gpufleet.backends.ray.backend.NodeAgent` actor starts it with the event channel's socket as
its stdout; it runs the per-node agent (:mod:`gpufleet.backends.agent`) and stops when the actor dies.
"""

from __future__ import annotations

import json
import os
import signal
import sys

from gpufleet.backends.agent import Agent
from gpufleet.backends.base import LaunchSpec
from gpufleet.core.env import Env

__all__ = ["main"]


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent (the actor) dies: the agent then stops its ranks."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main() -> int:
    raw, node = Env.AGENT_SPEC.get(), Env.NODE.get()
    if not raw or not node:
        print(
            "gpufleet ray agent: $GPUFLEET_AGENT_SPEC/$GPUFLEET_NODE unset (the ray backend sets them)",
            file=sys.stderr,
        )
        return 2
    _die_with_parent()
    spec = LaunchSpec(**json.loads(raw))
    if spec.log_dir is None:  # worker output must never reach stdout: that is the event channel
        spec.log_dir = os.path.join(spec.env[Env.RUN_DIR], "logs")
    return Agent(spec, node, Env.AGENT_GRACE.get()).run()

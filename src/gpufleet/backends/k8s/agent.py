"""The worker pod's entry, ``python -m gpufleet.backends.k8s``: one gpufleet node agent per pod.

It connects to the supervisor's Service (:mod:`gpufleet.backends.channel`), says who it is (token, node
rank, node name), and runs the node agent (:mod:`gpufleet.backends.agent`) with the connection as its
stdout, so the ranks' events reach the supervisor as on Slurm. The same connection carries the
supervisor's requests back: ``USR1`` (final checkpoint) and ``TERM`` (stop); a closed connection stops
the agent too. ``python -m gpufleet.backends.k8s prestop --wait S`` is the pod's preStop hook.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time

from gpufleet.backends.agent import Agent, exit_report
from gpufleet.backends.base import LaunchSpec
from gpufleet.backends.channel import connect, send_hello
from gpufleet.core.env import Env, Platform
from gpufleet.core.launch import node_name

__all__ = ["CHANNEL_ENV", "agent_main", "prestop", "main"]

CHANNEL_ENV = "GPUFLEET_K8S_CHANNEL"  # "HOST:PORT TOKEN": where the agent reports (set in the pod spec)


def _control(sock: socket.socket) -> None:
    """Turn the supervisor's requests into signals to this process; a closed channel stops it."""
    buf = b""
    while True:
        try:
            chunk = sock.recv(256)
        except OSError:
            chunk = b""
        if not chunk:
            os.kill(os.getpid(), signal.SIGTERM)
            return
        *lines, buf = (buf + chunk).split(b"\n")
        for line in lines:
            sig = {b"USR1": signal.SIGUSR1, b"TERM": signal.SIGTERM}.get(line.strip())
            if sig is not None:
                os.kill(os.getpid(), sig)


def agent_main() -> int:
    """The worker pod's entry: connect, say hello, relay events on the connection, obey requests."""
    raw, channel = Env.AGENT_SPEC.get(), Env.K8S_CHANNEL.get()
    if not raw or not channel or " " not in channel:
        print(f"gpufleet k8s agent: ${Env.AGENT_SPEC} and ${Env.K8S_CHANNEL} must be set", file=sys.stderr)
        return 2
    address, token = channel.split(" ", 1)
    spec = LaunchSpec(**json.loads(raw))
    index = Platform.JOB_COMPLETION_INDEX.get()
    spec.node_rank = spec.node_rank if index is None else index
    if spec.log_dir is None:  # worker output must never reach stdout: that is the event channel
        spec.log_dir = os.path.join(spec.env[Env.RUN_DIR], "logs")
    node, grace_s = node_name(), Env.AGENT_GRACE.get()
    host, _, port = address.rpartition(":")
    sock = connect(host, int(port), grace_s * 60)
    sock.settimeout(None)  # blocking from here: the channel is quiet for as long as training needs
    send_hello(sock, token, str(spec.node_rank), node)
    os.dup2(sock.fileno(), 1)
    threading.Thread(target=_control, args=(sock,), daemon=True).start()
    return Agent(spec, node, grace_s).run()


def prestop(wait_s: float, pid: int = 1) -> int:
    """The pod's preStop hook: ask the agent (PID 1) for a final checkpoint, wait until it has exited
    its ranks (its exit report exists) or ``wait_s`` passed; Kubernetes sends SIGTERM after."""
    raw = Env.AGENT_SPEC.get()
    spec = json.loads(raw) if raw else {}
    node = node_name()
    try:
        os.kill(pid, signal.SIGUSR1)
    except (ProcessLookupError, PermissionError):
        return 0
    run_dir, attempt = spec.get("env", {}).get(Env.RUN_DIR), spec.get("attempt", 0)
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        if run_dir and exit_report(run_dir, attempt, node) is not None:
            break
        time.sleep(0.5)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["prestop"]:
        wait = float(args[args.index("--wait") + 1]) if "--wait" in args else 100.0
        return prestop(wait)
    return agent_main()

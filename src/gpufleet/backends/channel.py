"""The TCP event channel between a supervisor and its node agents (the Ray and Kubernetes backends).

The supervisor listens on a port. Each node's side connects, sends one hello line (a token that names
the attempt, then who it is: its node rank, and on Kubernetes its node name) and hands the connected
socket to its node agent as stdout, so the agent's relayed event lines reach the supervisor as the
srun backend's pipe does. The supervisor reads the hello (:func:`read_hello`) without consuming
anything after it, then reads the rest with :class:`~gpufleet.backends.process.PipeChannel`.
"""

from __future__ import annotations

import socket
import time

from gpufleet.core.errors import ConfigError

__all__ = ["connect", "read_hello", "send_hello"]

HELLO_MAX = 256  # bytes: a hello is a token and a few names


def connect(host: str, port: int, deadline_s: float, attempt_timeout_s: float = 10.0) -> socket.socket:
    """A connection to the supervisor, retried until ``deadline_s`` passes (its Service, or its DNS
    name, may not be ready yet); ConfigError after that."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            return socket.create_connection((host, port), timeout=attempt_timeout_s)
        except OSError as e:
            if time.monotonic() > end:
                raise ConfigError(f"cannot reach the supervisor at {host}:{port}: {e}") from None
            time.sleep(1.0)


def send_hello(sock: socket.socket, *words: str) -> None:
    """Say who this side is: one line of space-separated words."""
    sock.sendall(" ".join(words).encode() + b"\n")


def read_hello(conn: socket.socket, timeout: float) -> list[str]:
    """The words of one hello line, read a byte at a time so nothing after it is consumed; ``[]`` when
    the peer sent nothing in time."""
    conn.settimeout(timeout)
    buf = b""
    try:
        while not buf.endswith(b"\n") and len(buf) < HELLO_MAX:
            b = conn.recv(1)
            if not b:
                break
            buf += b
    except OSError:
        return []
    conn.settimeout(None)
    return buf.decode(errors="replace").split()

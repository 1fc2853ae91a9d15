"""Free TCP ports that stay free until a child process binds them.

A port from ``bind(port 0)`` comes from the kernel's ephemeral range, the same range outgoing
connections draw their local ports from. Between closing the probe socket and the child's bind
(seconds, while torch imports), any outgoing connection on the host can take it. Ports below the
ephemeral range are never handed out that way: once one is seen free, only an explicit bind by
another program can take it. So pick there, at random, and probe; fall back to the kernel's choice.
"""

from __future__ import annotations

import random
import socket

__all__ = ["free_port", "free_ports"]

_FLOOR = 10000  # well above the registered well-known services most hosts run
_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def _ephemeral_low() -> int:
    try:
        with open(_RANGE_FILE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; macOS uses 49152


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_ports(n: int, host: str = "127.0.0.1", *, seed: int | None = None) -> list[int]:
    """``n`` distinct ports that were free on ``host``, below the ephemeral range when possible."""
    rng = random.Random(seed)
    low = _ephemeral_low()
    out: list[int] = []
    if low - _FLOOR > 100 * n:
        for _ in range(50 * n):
            port = rng.randrange(_FLOOR, low)
            if port not in out and _bindable(host, port):
                out.append(port)
                if len(out) == n:
                    return out
    socks: list[socket.socket] = []
    try:  # held open together so the kernel's picks differ
        while len(out) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
            out.append(int(s.getsockname()[1]))
    finally:
        for s in socks:
            s.close()
    return out


def free_port(host: str = "127.0.0.1") -> int:
    """One port that was free on ``host`` (see :func:`free_ports`)."""
    return free_ports(1, host)[0]

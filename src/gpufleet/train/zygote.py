"""The warm interpreter: imports torch once per run, forks every standby and hosts the rendezvous stores.

Started by the local backend (backends/zygote.py) as ``python -m gpufleet.train.zygote REQ_FD
STORE_FD``, with the environment the ranks get. Without it every standby interpreter imports torch,
``torch.distributed``, ``torch._dynamo`` and DCP itself (5-6 CPU-seconds each on the CI host) and the
supervisor imports torch for the store: a two-rank run with one restart paid that five or six times.
Here it is paid once; a standby is a ``fork`` of an interpreter that has the modules imported and has
never run an operator, made a CUDA context, opened a socket or started a thread of its own at fork time.

In order:

1. ``import torch.distributed`` in the main thread at normal priority: the first attempt's store waits
   for it, as it waited for the supervisor's own import.
2. With ``STORE_FD`` >= 0, fork the **store host**: a child that owns the socket ``STORE_FD`` and, per
   request, closes the last attempt's c10d ``TCPStore`` and opens the next one (torchrun's agent store).
   It is forked before any other thread or socket exists, so no standby inherits a store's listening
   socket (a fixed ``--master-port`` is bound again by the next attempt).
3. At the first standby asked for (a run that never wants one never pays them), the rest of the
   standby's imports (train/standby.py, ``IMPORTS``) in a helper thread, at ``SCHED_IDLE`` unless that
   request is eager; a later eager request or a ``hurry`` returns the thread to normal priority where
   permitted (train/standby.py says why a thread and not the process: a forked child inherits the
   forking thread's policy, and the main thread keeps normal priority). Forks wait for the imports: a
   fork while another thread imports could copy a held import lock.

Requests come as ``SOCK_SEQPACKET`` messages on ``REQ_FD``, one JSON object each:

- ``{"fork": ID, "env": {...}, "eager": bool}`` with two file descriptors attached: the standby's
  order pipe, which becomes its fd 0, and its event pipe, which ``GPUFLEET_CONTROL_FD`` names to it;
- ``{"hurry": true}``: the supervisor waits for a standby; finish the imports at normal priority;
- ``{"cancel": ID}``: a fork not made yet is not wanted.

Replies are ``{"forked": ID, "pid": P}`` and ``{"exited": P, "code": C}`` (the code as ``Popen`` gives
it: negative for a signal). A forked standby starts a session of its own, takes the environment it was
sent and runs :func:`gpufleet.train.standby.main`; it exits as an interpreter started for it would, its
atexit handlers and non-daemon threads included. The zygote ends when the supervisor closes ``REQ_FD``;
the store host when it closes ``STORE_FD``.
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import socket
import sys
import threading
from collections import deque

from gpufleet.core.env import Env

__all__ = ["main"]

_MAX_MSG = 1 << 20  # one request: an environment is a few kB
_NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"  # torch's own switch, documented for forked processes


def _warm(idle: bool) -> None:
    from gpufleet.train.priority import set_idle
    from gpufleet.train.standby import IMPORTS

    if idle:
        set_idle()
    for mod in IMPORTS:
        __import__(mod)


def _host_stores(sock: socket.socket) -> None:
    """The store host's loop: ``open ADDR PORT WORLD`` replaces the store; answers ``ok`` or ``error ...``."""
    import datetime

    from torch.distributed import TCPStore

    live: list[TCPStore] = []  # the attempt's store, kept alive until the next one replaces it
    for line in sock.makefile("r"):
        parts = line.split()
        if parts[:1] != ["open"] or len(parts) != 4:
            continue
        live.clear()  # the last attempt's first: a fixed port is bound again
        try:
            live.append(  # the only reference: clear() closes it
                TCPStore(
                    parts[1],
                    int(parts[2]),
                    int(parts[3]),
                    is_master=True,
                    wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=300),
                )
            )
            sock.sendall(b"ok\n")
        except Exception as e:  # noqa: BLE001 - reported to the supervisor, which fails the attempt
            sock.sendall(f"error {' '.join(str(e).split())}\n".encode())


def _child(sock: socket.socket, wake: int, env: dict[str, str], order_fd: int, control_fd: int) -> None:
    """In a forked standby: leave the zygote's descriptors and signals, take the standby's environment."""
    os.setsid()
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    sock.close()
    os.close(wake)
    os.dup2(order_fd, 0)
    os.close(order_fd)
    os.environ.clear()
    os.environ.update({**env, Env.CONTROL_FD: str(control_fd)})


def _serve(sock: socket.socket) -> tuple[dict[str, str], int, int] | None:
    """The request loop. Returns only in a forked child: its environment and descriptors."""
    from gpufleet.train.priority import restore_threads

    warm: threading.Thread | None = None

    r_wake, w_wake = os.pipe()
    os.set_blocking(w_wake, False)
    signal.set_wakeup_fd(w_wake)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # the wake-up byte is what matters
    waiting: deque[tuple[int, dict[str, str], int, int]] = deque()
    frozen = False
    while True:
        importing = warm is not None and warm.is_alive()
        if not importing and waiting:
            if not frozen:  # the imports' objects stay out of every collection, in every child
                gc.freeze()
                frozen = True
            fid, env, order_fd, control_fd = waiting.popleft()
            pid = os.fork()
            if pid == 0:
                os.close(w_wake)
                _child(sock, r_wake, env, order_fd, control_fd)
                return env, order_fd, control_fd
            os.close(order_fd)
            os.close(control_fd)
            sock.send(json.dumps({"forked": fid, "pid": pid}).encode())
            continue
        ready, _, _ = select.select([sock, r_wake], [], [], 0.05 if importing else None)
        if r_wake in ready:
            os.read(r_wake, 4096)
            _reap(sock)
        if sock not in ready:
            continue
        try:
            msg, fds, _, _ = socket.recv_fds(sock, _MAX_MSG, 2)
        except ConnectionResetError:
            msg, fds = b"", []
        if not msg:  # the supervisor is gone or done: standbys not yet made are not wanted
            for _, _, a, b in waiting:
                os.close(a)
                os.close(b)
            return None
        req = json.loads(msg)
        if "fork" in req:
            waiting.append((req["fork"], req["env"], fds[0], fds[1]))
            if warm is None:  # the first standby asked for: a run that never wants one never pays
                warm = threading.Thread(
                    target=_warm, args=(not req.get("eager"),), name="gpufleet-zygote-warm", daemon=True
                )
                warm.start()
            elif req.get("eager"):
                restore_threads()
        elif req.get("hurry"):
            restore_threads()
        elif "cancel" in req:
            for item in [w for w in waiting if w[0] == req["cancel"]]:
                waiting.remove(item)
                os.close(item[2])
                os.close(item[3])


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        try:
            sock.send(json.dumps({"exited": pid, "code": os.waitstatus_to_exitcode(status)}).encode())
        except OSError:
            pass  # the supervisor is gone


def main() -> None:
    req_fd, store_fd = (int(a) for a in sys.argv[1:3])
    # CUDA must never be initialized here, or no fork of this process could use it: a module that asks
    # torch.cuda.is_available() as it loads asks NVML instead, which makes no CUDA context. The forked
    # ranks take the environment they are sent, without this.
    os.environ[_NVML_CHECK] = "1"
    import torch.distributed  # noqa: F401 - the store's, at normal priority: the first attempt waits for it

    if store_fd >= 0:
        if os.fork() == 0:
            os.close(req_fd)
            os.setsid()
            _host_stores(socket.socket(fileno=store_fd))
            os._exit(0)
        os.close(store_fd)
    forked = _serve(socket.socket(fileno=req_fd))
    if forked is None:
        return
    from gpufleet.train import standby as standby_main

    standby_main.main()


if __name__ == "__main__":
    main()

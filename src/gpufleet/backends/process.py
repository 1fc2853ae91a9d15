"""Parts shared by backends whose workers are child processes of this host (local, srun, the agent).

:class:`PipeChannel` reads JSON event lines from the read ends of the workers' pipes.
:class:`ProcessAttempt` is an :class:`~gpufleet.backends.base.Attempt` over ``Popen`` objects.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import time
from collections.abc import Collection, Mapping
from typing import IO, Any

from gpufleet.backends.base import Attempt, EventChannel, LaunchSpec, Worker

__all__ = ["PipeChannel", "ProcessAttempt", "send_signal"]


class PipeChannel(EventChannel):
    """Whole JSON lines from several pipes; a line without a ``rank`` gets its pipe's rank."""

    def __init__(self, fds: dict[int, int]) -> None:  # read fd -> the rank of the worker writing it
        self._sel = selectors.DefaultSelector()
        self._buf: dict[int, bytes] = {}
        self._fds = dict(fds)
        for fd, rank in self._fds.items():
            os.set_blocking(fd, False)
            self._sel.register(fd, selectors.EVENT_READ, rank)
            self._buf[fd] = b""

    def read_lines(self, timeout: float) -> list[tuple[int, bytes]]:
        """(pipe rank, line) for each whole line that arrived within ``timeout`` seconds."""
        if not self._sel.get_map():
            if timeout > 0:
                time.sleep(timeout)  # every writer is gone: keep the caller's pace
            return []
        out: list[tuple[int, bytes]] = []
        for key, _ in self._sel.select(timeout):
            fd = int(key.fd)
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                continue
            if not chunk:  # writer closed (worker exited); drop a torn last line
                self._sel.unregister(fd)
                self._buf[fd] = b""
                continue
            *lines, self._buf[fd] = (self._buf[fd] + chunk).split(b"\n")
            out += [(key.data, line) for line in lines]
        return out

    def read(self, timeout: float) -> list[dict[str, Any]]:
        events = []
        for rank, line in self.read_lines(timeout):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict):
                rec.setdefault("rank", rank)
                events.append(rec)
        return events

    def closed(self, rank: int) -> bool:
        """True once the pipe of ``rank`` reached end of file (every writer closed it: the worker exited)."""
        mine = [fd for fd, r in self._fds.items() if r == rank]
        sel = self._sel.get_map()
        return bool(mine) and (sel is None or all(fd not in sel for fd in mine))

    def release(self, rank: int) -> int:
        """Stop reading the pipe of ``rank`` and return its fd, open (another channel takes it over)."""
        fd = next(fd for fd, r in self._fds.items() if r == rank)
        del self._fds[fd]
        self._buf.pop(fd, None)
        try:
            self._sel.unregister(fd)
        except (KeyError, ValueError):
            pass  # its writer had closed it already
        return fd

    def close(self) -> None:
        if self._sel.get_map() is None:  # closed already
            return
        for fd in self._fds:
            try:
                self._sel.unregister(fd)
            except (KeyError, ValueError):
                pass
            try:
                os.close(fd)
            except OSError:
                pass
        self._sel.close()


_Handed = tuple[Worker, "subprocess.Popen[bytes]", int, IO[bytes]]  # worker, process, event fd, order pipe


class ProcessAttempt(Attempt):
    """Workers that are ``Popen`` children of this process, each writing events to its own pipe.

    ``group``: signal each worker's whole process group (it was started in a new session), so what
    a rank started dies with it; else only the process, which forwards signals itself (srun).
    ``stop_extra_s``: time beyond the grace a worker needs to stop what is behind it (an agent's ranks).
    ``orders``: per rank, the stdin of a worker run by the in-process restart harness (the next round's
    order is written there; see :meth:`handover`).
    """

    def __init__(
        self,
        spec: LaunchSpec,
        started: list[tuple[Worker, subprocess.Popen[bytes], int]],  # worker, process, event pipe fd
        *,
        group: bool = True,
        stop_extra_s: float = 0.0,
        orders: Mapping[int, IO[bytes]] | None = None,
    ) -> None:
        self.spec = spec
        self.workers = [w for w, _, _ in started]
        self.procs = {w.rank: p for w, p, _ in started}
        self.events: PipeChannel = PipeChannel({fd: w.rank for w, _, fd in started})
        self.group = group
        self.stop_extra_s = stop_extra_s
        self.orders = dict(orders or {})

    def poll(self) -> dict[int, int | None]:
        return {rank: p.poll() for rank, p in self.procs.items()}

    def request_final_checkpoint(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                send_signal(p, signal.SIGUSR1, group=False)  # the rank itself: it checkpoints, then exits

    def kill(self, ranks: Collection[int]) -> None:
        """SIGKILL these ranks (and what they started) and reap them; the others keep running."""
        for r in ranks:
            if r in self.procs:
                send_signal(self.procs[r], signal.SIGKILL, self.group)
        for r in ranks:
            if r in self.procs:
                self.procs[r].wait()

    def handover(self, ranks: Collection[int]) -> dict[int, _Handed]:
        """Give these live ranks to the next attempt (in-process restart): their process, event pipe and
        order pipe leave this attempt, so neither :meth:`stop` nor :meth:`close` touches them."""
        out = {}
        for w in [w for w in self.workers if w.rank in ranks]:
            fd = self.events.release(w.rank)
            out[w.rank] = (w, self.procs.pop(w.rank), fd, self.orders.pop(w.rank))
            self.workers.remove(w)
        return out

    def close(self) -> None:
        for o in self.orders.values():
            try:
                o.close()
            except OSError:
                pass
        self.orders.clear()
        super().close()

    def stop(self, grace_s: float) -> None:
        for p in self.procs.values():
            send_signal(p, signal.SIGTERM, self.group)
        deadline = time.monotonic() + grace_s + self.stop_extra_s
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in self.procs.values():
            if self.group or p.poll() is None:
                send_signal(p, signal.SIGKILL, self.group)  # a group also loses children left behind
            p.wait()


def send_signal(proc: subprocess.Popen[bytes], sig: int, group: bool) -> None:
    """Signal ``proc`` (or its process group), ignoring one that is already gone."""
    try:
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
    except (ProcessLookupError, PermissionError):
        pass

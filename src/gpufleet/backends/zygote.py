"""The supervisor's side of the warm interpreter (train/zygote.py): standbys forked, stores hosted.

:class:`Zygote` starts the warm interpreter lazily, asks it for standbys and for each attempt's
rendezvous store, and keeps the exit codes it relays. A forked standby is a child of the zygote, not of
this process, so it is handled through :class:`ForkedProcess`, which answers what ``Popen`` answers
(``pid``, ``stdin``, ``poll``, ``wait``, ``send_signal``, ``kill``) from those relayed codes.

A fork request does not wait for the fork: the zygote makes it once its imports are done, and the
handle's ``pid`` waits for it then (and asks the zygote to finish at normal priority), so the
supervisor's loop is never held up by a standby that is still being made.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
from collections.abc import Mapping
from typing import IO

from gpufleet.core.errors import SupervisorError

__all__ = ["ForkedProcess", "Zygote"]

# A standby whose zygote vanished (killed from outside) is reported as killed.
_LOST = -int(signal.SIGKILL)


class ForkedProcess:
    """A standby forked by the zygote: ``Popen``'s interface over the exit code the zygote relays."""

    def __init__(self, zygote: Zygote, fork_id: int, stdin: IO[bytes]) -> None:
        self._zygote = zygote
        self.fork_id = fork_id
        self.stdin: IO[bytes] | None = stdin
        self.known_pid: int | None = None  # once the zygote has made it (`pid` waits for it)
        self.returncode: int | None = None

    @property
    def pid(self) -> int:
        """The standby's pid; waits for the fork (asking the zygote to hurry) when not made yet."""
        if self.known_pid is None:
            self._zygote.wait_forked(self)
        assert self.known_pid is not None
        return self.known_pid

    @property
    def forked(self) -> bool:
        """Whether the zygote has made it (a standby asked for may still wait for the imports)."""
        return self.known_pid is not None

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self._zygote.wait_exit(self, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"standby {self.known_pid}", timeout or 0.0)
        return code

    def cancel(self) -> None:
        """A standby not made yet never will be (its exit code: -SIGTERM); one made is not touched."""
        self._zygote.cancel(self)

    def send_signal(self, sig: int) -> None:
        if self.returncode is None and self.known_pid is not None:
            try:
                os.kill(self.known_pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class Zygote:
    """One warm interpreter per local backend; started on first use, ended by :meth:`close`."""

    def __init__(self, python: str, env: Mapping[str, str], *, store: bool) -> None:
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._store_sock: socket.socket | None = None
        store_theirs: socket.socket | None = None
        if store:
            self._store_sock, store_theirs = socket.socketpair()
        fds = [theirs.fileno()] + ([store_theirs.fileno()] if store_theirs else [])
        argv = [
            python,
            "-m",
            "gpufleet.train.zygote",
            str(theirs.fileno()),
            str(store_theirs.fileno()) if store_theirs else "-1",
        ]
        self.proc = subprocess.Popen(
            argv, env=dict(env), pass_fds=fds, stdin=subprocess.DEVNULL, start_new_session=True
        )
        theirs.close()
        if store_theirs is not None:
            store_theirs.close()
        self._store_reader = self._store_sock.makefile("r") if self._store_sock else None
        self._next_id = 0
        self._children: dict[int, ForkedProcess] = {}  # by fork id, until it exits
        self._by_pid: dict[int, ForkedProcess] = {}
        self._gone = False
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, name="gpufleet-zygote-reader", daemon=True)
        self._reader.start()

    # -- standbys ------------------------------------------------------------------------------
    def fork(self, env: Mapping[str, str], control_fd: int, *, eager: bool) -> ForkedProcess:
        """A standby with this environment, reporting on ``control_fd`` (a pipe's write end)."""
        r, w = os.pipe()
        with self._cond:
            fork_id = self._next_id
            self._next_id += 1
            handle = ForkedProcess(self, fork_id, open(w, "wb"))  # noqa: SIM115 - the standby's stdin
            self._children[fork_id] = handle
            msg = json.dumps({"fork": fork_id, "env": dict(env), "eager": eager}).encode()
            try:
                socket.send_fds(self._sock, [msg], [r, control_fd])
            except OSError:
                self._lose_all()
            finally:
                os.close(r)
        return handle

    def wait_forked(self, handle: ForkedProcess) -> None:
        with self._cond:
            if handle.known_pid is None and not self._gone:
                self._send({"hurry": True})
            while handle.known_pid is None and handle.returncode is None:
                self._cond.wait()
            if handle.known_pid is None:
                raise SupervisorError("the warm interpreter ended before it made a standby", exit_code=1)

    def wait_exit(self, handle: ForkedProcess, timeout: float | None) -> int | None:
        with self._cond:
            if handle.known_pid is None and not self._gone:
                self._send({"hurry": True})
            self._cond.wait_for(lambda: handle.returncode is not None, timeout)
            return handle.returncode

    def cancel(self, handle: ForkedProcess) -> None:
        with self._cond:
            if handle.known_pid is None and handle.returncode is None:
                self._send({"cancel": handle.fork_id})
                self._exited(handle, -int(signal.SIGTERM))

    # -- stores --------------------------------------------------------------------------------
    def open_store(self, addr: str, port: int, world_size: int) -> None:
        """Replace the last attempt's rendezvous store with one on ``addr:port``."""
        assert self._store_sock is not None and self._store_reader is not None
        try:
            self._store_sock.sendall(f"open {addr} {port} {world_size}\n".encode())
            answer = self._store_reader.readline().strip()
        except OSError as e:
            answer = f"error {e}"
        if answer != "ok":
            reason = answer.removeprefix("error ").strip() or "the store host ended"
            raise SupervisorError(f"cannot host the rendezvous store on {addr}:{port}: {reason}", exit_code=1)

    # -- life ----------------------------------------------------------------------------------
    def close(self) -> None:
        """End the zygote and the store host; standbys it made are the backend's to stop."""
        for s in (self._sock, self._store_sock):
            if s is not None:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout=5)
        for s in (self._sock, self._store_sock):
            if s is not None:
                s.close()

    def alive(self) -> bool:
        return not self._gone and self.proc.poll() is None

    def _send(self, req: dict[str, object]) -> None:
        try:
            self._sock.send(json.dumps(req).encode())
        except OSError:
            self._lose_all()

    def _read(self) -> None:
        while True:
            try:
                msg = self._sock.recv(65536)
            except OSError:
                msg = b""
            with self._cond:
                if not msg:
                    self._lose_all()
                    return
                reply = json.loads(msg)
                if "forked" in reply:
                    handle = self._children.get(reply["forked"])
                    if handle is not None:
                        handle.known_pid = reply["pid"]
                        self._by_pid[reply["pid"]] = handle
                elif "exited" in reply:
                    handle = self._by_pid.pop(reply["exited"], None)
                    if handle is not None:
                        self._exited(handle, reply["code"])
                self._cond.notify_all()

    def _exited(self, handle: ForkedProcess, code: int) -> None:
        handle.returncode = code
        self._children.pop(handle.fork_id, None)

    def _lose_all(self) -> None:
        """The zygote is gone: its standbys' exit codes will never come; those still running are
        reparented and run on (the backend signals them), so they count as killed from here on."""
        self._gone = True
        for handle in list(self._children.values()):
            self._exited(handle, _LOST)
        self._by_pid.clear()
        self._cond.notify_all()

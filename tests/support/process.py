"""Plumbing shared by the test services that run as child processes (SeaweedFS, llama.cpp server,
``gpufleet serve mock``, the flaky S3 proxy): free loopback ports, is-a-PID-alive, stop by PID
(SIGTERM, then SIGKILL), the ``with`` protocol, and the pid/env files of the start/stop CLIs."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from gpufleet.core.ports import free_ports

__all__ = [
    "ChildService",
    "child_env",
    "free_ports",
    "is_alive",
    "read_env_file",
    "running_pid",
    "stop_pid",
    "stop_pid_file",
    "write_env_file",
]


# tests/ (so that ``import support`` works) and src/ (gpufleet from a checkout, installed or not)
_TESTS = Path(__file__).resolve().parents[1]
_SRC = _TESTS.parent / "src"


def child_env() -> dict[str, str]:
    """This process's environment with tests/ and src/ in front of ``PYTHONPATH``, for a child that
    runs ``python -m support.<service>``."""
    paths = [str(_TESTS), str(_SRC), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie still answers kill(0): reap it if it is our child, else read its state.
    with contextlib.suppress(ChildProcessError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc (not Linux): trust kill(0)
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def stop_pid(pid: int, grace_s: float = 5.0) -> None:
    """SIGTERM ``pid``, then SIGKILL if it is still alive after ``grace_s`` seconds."""
    if not is_alive(pid):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not is_alive(pid):
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and is_alive(pid):
        time.sleep(0.05)


def running_pid(pid_file: Path) -> int | None:
    """The PID in ``pid_file`` if the file exists and that process is alive, else None."""
    if pid_file.is_file():
        pid = int(pid_file.read_text().strip())
        if is_alive(pid):
            return pid
    return None


def stop_pid_file(pid_file: Path, grace_s: float) -> bool:
    """Stop the process ``pid_file`` names (:func:`stop_pid`) and remove the file; False if no file."""
    if not pid_file.is_file():
        return False
    stop_pid(int(pid_file.read_text().strip()), grace_s)
    pid_file.unlink()
    return True


def write_env_file(path: str | os.PathLike[str], env: Mapping[str, str], mode: int | None = None) -> None:
    """``export K=V`` lines, one a variable, for a shell to ``source``; ``mode``: chmod it. Written
    to a temporary name and renamed, so a reader waiting for the file never sees half of it."""
    path = Path(path)
    lines = [f"export {k}={v}" for k, v in env.items()]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    if mode is not None:
        tmp.chmod(mode)
    tmp.replace(path)


def read_env_file(path: str | os.PathLike[str]) -> dict[str, str]:
    """The variables of a :func:`write_env_file` file."""
    out = {}
    for line in Path(path).read_text().splitlines():
        key, sep, value = line.removeprefix("export ").partition("=")
        if sep:
            out[key.strip()] = value.strip()
    return out


class ChildService:
    """Base of a service run as the child process ``self._proc``: ``pid``, and a ``with`` block that
    calls ``start()`` on entry and ``stop()`` on exit."""

    _proc: subprocess.Popen[Any] | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self) -> Self:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def _stop_proc(self, grace_s: float) -> None:
        """Stop the child by PID (:func:`stop_pid`), reap it, forget it."""
        if self._proc is not None:
            stop_pid(self._proc.pid, grace_s)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=1.0)
            self._proc = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

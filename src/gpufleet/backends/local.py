"""Run ranks as child processes of this host's supervisor, optionally from pre-spawned standbys."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from gpufleet.backends.base import Backend, LaunchSpec, Worker
from gpufleet.backends.process import ProcessAttempt, send_signal
from gpufleet.core.env import Env

__all__ = ["LocalBackend", "python_entry"]


def python_entry(command: list[str]) -> tuple[list[str], bool] | None:
    """(argv, is_module) when ``command`` is ``python SCRIPT ...`` or ``python -m MOD ...``; else None.

    Only those shapes can be handed to a standby interpreter; anything else is spawned fresh.
    """
    if not command or not os.path.basename(command[0]).startswith("python"):
        return None
    rest = command[1:]
    if len(rest) >= 2 and rest[0] == "-m":
        return [rest[1], *rest[2:]], True
    if rest and not rest[0].startswith("-") and rest[0].endswith(".py"):
        return rest, False
    return None


@dataclass
class _Standby:
    proc: subprocess.Popen[bytes]
    read_fd: int
    write_fd: int


class LocalBackend(Backend):
    """Ranks are child processes of this process: fresh, or standby interpreters made ready earlier."""

    name = "local"

    def __init__(self, standby: bool = True, python: str | None = None) -> None:
        self.standby = standby
        self.python = python or sys.executable
        self._standbys: list[_Standby] = []

    # -- hooks ---------------------------------------------------------------------------------
    def prepare(self, spec: LaunchSpec) -> None:
        if not self.standby or python_entry(spec.command) is None:
            return
        while len(self._standbys) < spec.nproc_per_node:
            r, w = os.pipe()
            env = {**os.environ, **spec.env, Env.CONTROL_FD: str(w)}
            proc = subprocess.Popen(
                [self.python, "-m", "gpufleet.train.standby"],
                stdin=subprocess.PIPE,
                env=env,
                pass_fds=(w,),
                start_new_session=True,
            )
            self._standbys.append(_Standby(proc, r, w))

    def start(self, spec: LaunchSpec) -> ProcessAttempt:
        entry = python_entry(spec.command)
        started: list[tuple[Worker, subprocess.Popen[bytes], int]] = []
        for local_rank in range(spec.nproc_per_node):
            env = {**spec.env, **spec.rank_env(local_rank)}
            rank = int(env["RANK"])
            sb = self._take_standby() if entry is not None else None
            if sb is not None and entry is not None and sb.proc.stdin is not None:
                argv, is_module = entry
                order = {
                    "env": {**env, Env.CONTROL_FD: str(sb.write_fd)},
                    "argv": argv,
                    "module": is_module,
                    "log": _prepare_log(spec.log_path(rank)),
                }
                sb.proc.stdin.write((json.dumps(order) + "\n").encode())
                sb.proc.stdin.flush()
                sb.proc.stdin.close()
                os.close(sb.write_fd)
                started.append((Worker(rank, sb.proc.pid), sb.proc, sb.read_fd))
                continue
            r, w = os.pipe()
            full_env = {
                **os.environ,
                **env,
                Env.CONTROL_FD: str(w),
                Env.SPAWN_T: str(time.time()),
            }
            log = _prepare_log(spec.log_path(rank))
            out = open(log, "ab") if log else None  # noqa: SIM115 - handed to the child, closed right after
            try:
                proc = subprocess.Popen(
                    spec.command,
                    env=full_env,
                    pass_fds=(w,),
                    start_new_session=True,
                    stdout=out,
                    stderr=subprocess.STDOUT if out else None,
                )
            finally:
                if out:
                    out.close()
            os.close(w)
            started.append((Worker(rank, proc.pid), proc, r))
        return ProcessAttempt(spec, started, group=True)

    def close(self) -> None:
        for sb in self._standbys:
            if sb.proc.stdin is not None:
                sb.proc.stdin.close()  # EOF: the standby exits by itself
            send_signal(sb.proc, signal.SIGTERM, group=True)
            sb.proc.wait()
            os.close(sb.read_fd)
            os.close(sb.write_fd)
        self._standbys.clear()

    # -- helpers -------------------------------------------------------------------------------
    def _take_standby(self) -> _Standby | None:
        while self._standbys:
            sb = self._standbys.pop(0)
            if sb.proc.poll() is None:
                return sb
            os.close(sb.read_fd)
            os.close(sb.write_fd)
        return None


def _prepare_log(path: str | None) -> str | None:
    if path is not None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
    return path


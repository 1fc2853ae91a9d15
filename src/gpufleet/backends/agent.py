"""The per-node agent that ``srun`` starts for the srun backend (``python -m gpufleet.backends.agent``).

It reads its :class:`~gpufleet.backends.base.LaunchSpec` from ``$GPUFLEET_AGENT_SPEC`` (JSON; the
supervisor chose ``node_rank``, ``master_addr`` and ``master_port``), starts this node's ranks with
the local backend, and relays their JSON event lines, whole lines only, to **its stdout**: srun
forwards that to the supervisor, where it is this node's control channel. Worker output goes to
per-rank log files so the channel carries events only.

Signals: SIGUSR1 is passed to the ranks (final checkpoint at the next step boundary); SIGTERM stops
them (SIGTERM, then SIGKILL after the grace period). When a rank fails, the agent stops the others
and exits with that rank's code at once, so srun (and the supervisor) hear about it immediately.

Reports, on the run directory (shared by all nodes): ``agents/attempt-A/NODE.json`` at start (pids,
Slurm step) and ``NODE.exit.json`` at exit (codes; ``worker_code``: the failed rank's own exit
code, -N for signal N, which the srun backend reports instead of the agent's 128+N). A node whose
agent never wrote its exit report is a candidate for "node lost" (see :mod:`gpufleet.backends.slurm.srun`).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from gpufleet.backends.base import LaunchSpec
from gpufleet.backends.local import LocalBackend
from gpufleet.backends.process import ProcessAttempt
from gpufleet.core.env import Env, Platform
from gpufleet.core.launch import node_name

__all__ = ["main", "report_dir", "exit_report"]


def report_dir(run_dir: str | os.PathLike[str], attempt: int) -> Path:
    return Path(run_dir) / "agents" / f"attempt-{attempt}"


def exit_report(run_dir: str | os.PathLike[str], attempt: int, node: str) -> dict[str, Any] | None:
    """What ``node``'s agent wrote when it exited in ``attempt``; None if it never did (or not yet)."""
    try:
        data = json.loads((report_dir(run_dir, attempt) / f"{node}.exit.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


class Agent:
    def __init__(self, spec: LaunchSpec, node: str, grace_s: float = Env.AGENT_GRACE.default) -> None:
        self.spec = spec
        self.node = node
        self.grace_s = grace_s
        self.backend = LocalBackend(standby=False, host_store=False)  # node 0's rank 0 hosts the store
        self._term = False
        self._usr1 = False
        self._worker_code: int | None = None
        self.reports = report_dir(spec.env[Env.RUN_DIR], spec.attempt)

    def _on_signal(self, signum: int, frame: object) -> None:
        if signum == signal.SIGUSR1:
            self._usr1 = True
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # forwarded once; Slurm may deliver it twice
        else:
            self._term = True

    def run(self) -> int:
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(s, self._on_signal)
        att = self.backend.start(self.spec)
        _write_json(
            self.reports / f"{self.node}.json",
            {
                "node": self.node,
                "pid": os.getpid(),
                "ppid": os.getppid(),
                "pids": [w.pid for w in att.workers],
                "ranks": [w.rank for w in att.workers],
                "job": Platform.SLURM_JOB_ID.get(),
                "step": Platform.SLURM_STEP_ID.get(),
                "t": time.time(),
            },
        )
        try:
            code = self._loop(att)
        finally:
            att.close()
        _write_json(
            self.reports / f"{self.node}.exit.json",
            {"node": self.node, "code": code, "codes": att.poll(), "worker_code": self._worker_code},
        )
        return code

    def _loop(self, att: ProcessAttempt) -> int:
        while True:
            if self._usr1:
                self._usr1 = False
                att.request_final_checkpoint()
            if self._term:
                att.stop(self.grace_s)
                self._relay(att, 0)
                return 143
            if not self._relay(att, 0.05):
                att.stop(self.grace_s)  # supervisor gone: no one to tell
                return 141
            codes = att.poll().values()
            bad = next((c for c in codes if c is not None and c != 0), None)
            if bad is not None:
                self._relay(att, 0.05)  # the failing rank's last words
                att.stop(self.grace_s)
                self._worker_code = bad
                return bad if bad > 0 else 128 - bad
            if all(c == 0 for c in codes):
                self._relay(att, 0)
                return 0

    def _relay(self, att: ProcessAttempt, timeout: float) -> bool:
        """Copy whole event lines from the ranks to stdout; False when stdout is gone."""
        lines = att.events.read_lines(timeout)
        if lines:
            try:
                _write_all(1, b"".join(line + b"\n" for _, line in lines))
            except BrokenPipeError:
                return False
        return True


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except BlockingIOError:
            time.sleep(0.001)
            continue
        view = view[n:]


def main() -> int:
    raw = Env.AGENT_SPEC.get()
    if not raw:
        print("gpufleet agent: $GPUFLEET_AGENT_SPEC is not set (the srun backend sets it)", file=sys.stderr)
        return 2
    spec = LaunchSpec(**json.loads(raw))
    if spec.log_dir is None:  # worker output must never reach stdout: that is the event channel
        spec.log_dir = os.path.join(spec.env[Env.RUN_DIR], "logs")
    return Agent(spec, node_name(), Env.AGENT_GRACE.get()).run()


if __name__ == "__main__":
    raise SystemExit(main())

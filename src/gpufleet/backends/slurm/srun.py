"""The srun backend: the supervisor inside a Slurm allocation starts one agent per node with srun.

Per attempt, one ``srun --nodes=1 --ntasks=1 --nodelist=NODE --overlap python -m gpufleet.backends.agent``
per active node (:mod:`gpufleet.backends.agent`). Each srun's stdout is that node's control channel
(the agent relays its ranks' event lines; each line names its rank). One srun per node rather than
one for all: a node's failure shows up at once as *its* srun exiting, and the others keep clean exit
codes to tell crash from loss.
A node's exit code is its failed rank's own (from the agent's exit report), so a rank killed by a
signal reads as such, as with the local backend.

After a failure, :meth:`SrunBackend.after_failure` decides which nodes were lost: those whose agent
wrote no exit report *and* that fail a short srun probe (a live slurmd answers in well under a
second; a dead one leaves srun waiting until the probe's timeout). Lost nodes are recorded as
``suspect`` in the node state log and drained (``gpufleet: node-lost: ...``, through the circuit
breaker). The next attempt runs on the healthy nodes: spare nodes of the allocation first (world size
unchanged), else fewer nodes down to ``min_nodes`` (world size shrinks; DCP reshards on load). Below
that the supervisor stops and the batch script requeues the job (``RUN_DIR/.gpufleet-requeue``);
the drained node keeps the scheduler off it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from gpufleet.backends.agent import exit_report
from gpufleet.backends.base import CONTINUE, Attempt, Backend, Blame, LaunchSpec, Verdict, Worker
from gpufleet.backends.environ import host_specific
from gpufleet.backends.process import ProcessAttempt
from gpufleet.core import events as E
from gpufleet.core.env import Env, Platform
from gpufleet.core.errors import ConfigError
from gpufleet.core.ledger import EventSink

__all__ = ["SrunBackend", "SrunAttempt", "hostnames", "node_addr", "REQUEUE_MARK"]

REQUEUE_MARK = ".gpufleet-requeue"


def _slurm(argv: list[str], timeout: float = 15.0) -> str:
    from gpufleet.backends.slurm.actions import run_slurm

    return run_slurm(argv, timeout)


def hostnames(nodelist: str) -> list[str]:
    """Expand a Slurm hostlist (``n[1-3]``) with ``scontrol show hostnames``."""
    return _slurm(["scontrol", "show", "hostnames", nodelist]).split()


def node_addr(node: str) -> str:
    """The address to reach ``node`` at (its NodeAddr; defaults to the name on real clusters)."""
    for tok in _slurm(["scontrol", "show", "node", "-o", node]).split():
        if tok.startswith("NodeAddr="):
            return tok.split("=", 1)[1]
    return node


class SrunAttempt(ProcessAttempt):
    """One srun (one node agent) per worker; srun forwards SIGUSR1/SIGTERM to the agent."""

    def __init__(
        self,
        spec: LaunchSpec,
        started: list[tuple[Worker, subprocess.Popen[bytes], int]],
        run_dir: Path,
        agent_grace_s: float,
    ) -> None:
        super().__init__(spec, started, group=False, stop_extra_s=agent_grace_s)
        self.run_dir = run_dir
        self._codes: dict[int, int] = {}

    def poll(self) -> dict[int, int | None]:
        out: dict[int, int | None] = {}
        for w in self.workers:
            code = self.procs[w.rank].poll()
            if code is not None and w.rank not in self._codes:
                report = exit_report(self.run_dir, self.spec.attempt, w.node or "")
                own = report.get("worker_code") if report else None
                self._codes[w.rank] = own if isinstance(own, int) and code != 0 else code
            out[w.rank] = None if code is None else self._codes[w.rank]
        return out


class SrunBackend(Backend):
    name = "srun"

    @classmethod
    def options(cls, flags: Mapping[str, Any]) -> dict[str, Any]:
        return {"nodes": flags["nodes"], "min_nodes": flags["min_nodes"]}

    def __init__(
        self,
        standby: bool = False,
        nodes: int | None = None,
        min_nodes: int | None = None,
        nodelist: list[str] | None = None,
        srun: str = "srun",
        python: str | None = None,
        probe_timeout: float = 8.0,
        agent_grace_s: float = Env.AGENT_GRACE.default,
    ) -> None:
        del standby  # no standby interpreters across srun (each attempt is a new step)
        listed = nodelist or Platform.SLURM_JOB_NODELIST.get() or Platform.SLURM_NODELIST.get()
        if not listed:
            raise ConfigError("the srun backend runs inside a Slurm allocation (no SLURM_JOB_NODELIST)")
        self.all_nodes = list(listed) if isinstance(listed, list) else hostnames(listed)
        self.want = nodes or len(self.all_nodes)
        self.min_nodes = min_nodes or self.want
        if not 1 <= self.min_nodes <= self.want <= len(self.all_nodes):
            raise ConfigError(
                f"need 1 <= min-nodes ({self.min_nodes}) <= nodes ({self.want}) "
                f"<= allocated ({len(self.all_nodes)})"
            )
        self.healthy = list(self.all_nodes)
        self.lost: list[str] = []  # nodes out of the job: lost, or drained as stragglers
        self.unreachable: list[str] = []  # lost nodes (their srun probe failed)
        self.active: list[str] = []
        self.srun = srun
        self.python = python or sys.executable
        self.probe_timeout = probe_timeout
        self.agent_grace_s = agent_grace_s
        self._run_dir: Path | None = None
        self._spec: LaunchSpec | None = None
        self.used: list[str] = []  # every node that ran an agent, in order

    # -- Backend hooks ---------------------------------------------------------------------------
    def start(self, spec: LaunchSpec) -> SrunAttempt:
        self.active = self.healthy[: self.want]
        self.used += [n for n in self.active if n not in self.used]
        self._spec = spec
        spec.nnodes = len(self.active)
        spec.master_addr = node_addr(self.active[0])
        run_dir = self._run_dir = Path(spec.env[Env.RUN_DIR])
        if spec.log_dir is None:
            spec.log_dir = str(run_dir / "logs")
        log_dir = Path(spec.log_dir) / f"attempt-{spec.attempt}"
        log_dir.mkdir(parents=True, exist_ok=True)
        started: list[tuple[Worker, subprocess.Popen[bytes], int]] = []
        # srun hands its own environment to the step (--export=ALL), so the launch's (spec.forward)
        # travels that way rather than in the spec. This host's host-specific variables stay behind,
        # but for SLURM_*: srun needs the allocation's to join it, and sets the new step's own on each node.
        own = {k: v for k, v in dict(os.environ).items() if k.startswith("SLURM_") or not host_specific(k)}
        for i, node in enumerate(self.active):
            sub = replace(spec, node_rank=i, forward={})
            env = {
                **own,
                **spec.forward,
                **spec.env,
                Env.AGENT_SPEC: json.dumps(asdict(sub)),
                Env.AGENT_GRACE: Env.AGENT_GRACE.format(self.agent_grace_s),
            }
            r, w = os.pipe()
            with open(log_dir / f"srun-{node}.log", "ab") as err:
                proc = subprocess.Popen(
                    self.argv(node),
                    stdin=subprocess.DEVNULL,
                    stdout=w,
                    stderr=err,
                    env=env,
                    start_new_session=True,
                )
            os.close(w)
            first = i * spec.nproc_per_node
            ranks = tuple(range(first, first + spec.nproc_per_node))
            started.append((Worker(first, proc.pid, ranks=ranks, node=node), proc, r))
        return SrunAttempt(spec, started, run_dir, self.agent_grace_s)

    def argv(self, node: str) -> list[str]:
        return [
            self.srun,
            "--nodes=1",
            "--ntasks=1",
            f"--nodelist={node}",
            "--overlap",  # a previous attempt's step may linger on this node for a moment
            "--kill-on-bad-exit=1",
            f"--job-name=gpufleet-agent-{node}",
            self.python,
            "-m",
            "gpufleet.backends.agent",
        ]

    def close(self) -> None:
        """Free the in-memory checkpoint tier (``--memory-tier``) on every node the run used.

        Each node's keeper outlives the attempts on purpose, so only the end of the run frees it; the
        supervisor's own exit frees the batch node's alone. One short srun step per reachable node, all
        at once (a node judged lost is skipped: its step would only wait for the timeout)."""
        spec, self._spec = self._spec, None
        if spec is None or Env.MEMORY_TIER.get(spec.env) in ("", "0"):
            return
        ckpt = Env.CKPT_DIR.get(spec.env) or str(Path(spec.env[Env.RUN_DIR]) / "checkpoints")
        code = "import sys; from gpufleet.checkpoint.storage.memory import release; release(sys.argv[1])"
        env = {**os.environ, **spec.env}
        procs = [
            subprocess.Popen(
                self.step(node, self.python, "-c", code, ckpt),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env=env,
            )
            for node in self.used
            if node not in self.unreachable
        ]
        for proc in procs:
            try:
                proc.wait(timeout=self.probe_timeout + 20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def step(self, node: str, *argv: str) -> list[str]:
        """A one-task step on ``node`` running ``argv``, beside whatever runs there (``--overlap``)."""
        return [self.srun, "--nodes=1", "--ntasks=1", f"--nodelist={node}", "--overlap", *argv]

    # -- node loss -------------------------------------------------------------------------------
    def probe(self, node: str) -> bool:
        """True when ``node``'s slurmd still launches a step (a trivial ``true``) in time."""
        try:
            p = subprocess.run(
                self.step(node, "true"),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=self.probe_timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return False
        return p.returncode == 0

    def after_failure(self, attempt: Attempt, ledger: EventSink, blame: Blame | None = None) -> Verdict:
        """Isolate lost nodes; restart on the healthy ones, or give up so the job requeues."""
        run_dir = self._run_dir or Path(".")
        number = attempt.spec.attempt
        silent = [w.node for w in attempt.workers if w.node and exit_report(run_dir, number, w.node) is None]
        lost = [n for n in silent if not self.probe(n)]
        # A node is judged lost by its missing exit report and a failed probe, not by blame; a straggler
        # (--straggler-action restart) is the exception: its node is slow, so it leaves the job too.
        if blame is not None and blame.cause == E.FailureCause.STRAGGLER:
            slow = next((w.node for w in attempt.workers if blame.rank in w.ranks and w.node), None)
            if slow is not None and slow not in lost and slow in self.healthy:
                reason = f"persistent straggler (rank {blame.rank}) in attempt {number}"
                self._isolate(slow, reason, ledger, check="straggler")
                self.healthy.remove(slow)
                self.lost.append(slow)
        for node in lost:
            reason = f"agent vanished in attempt {number} and srun probe failed"
            job = Platform.SLURM_JOB_ID.get()
            ledger.emit(E.NodeLost(node=node, attempt=number, reason=reason, job=job))
            self._isolate(node, reason, ledger, check="node-lost")
            self.healthy.remove(node)
            self.lost.append(node)
            self.unreachable.append(node)
        if len(self.healthy) >= self.min_nodes:
            return CONTINUE
        if self._run_dir is not None:
            (self._run_dir / REQUEUE_MARK).write_text(json.dumps({"lost": self.lost, "t": time.time()}))
        return Verdict(
            restart=False,
            reason=f"{len(self.healthy)} healthy node(s) left of {len(self.all_nodes)}, "
            f"need {self.min_nodes}: requeue without {','.join(self.lost)}",
        )

    def _isolate(self, node: str, reason: str, ledger: EventSink, check: str) -> None:
        from gpufleet.backends.slurm.actions import SlurmActions, SlurmError
        from gpufleet.health.nodes import record_state

        record_state(node, "suspect", reason, component="host", check=check)  # its reputation drops
        try:
            SlurmActions(sink=ledger).isolate(node, check, reason, component="host")
        except SlurmError as e:  # recorded as a failed node_action: the run goes on without the node
            print(f"gpufleet: could not drain {node}: {e}", file=sys.stderr)

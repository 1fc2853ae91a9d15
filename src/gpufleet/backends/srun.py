"""The srun backend: the supervisor inside a Slurm allocation starts one agent per node with srun.

Per attempt, one ``srun --nodes=1 --ntasks=1 --nodelist=NODE --overlap python -m gpufleet.cli.agent``
per active node. Each srun's stdout is that node's control channel (the agent relays its ranks'
event lines; each line names its rank). One srun per node rather than one for all: a node's failure
shows up at once as *its* srun exiting, and the others keep clean exit codes to tell crash from loss.

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
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from gpufleet.backends.base import LaunchSpec, Worker
from gpufleet.core.errors import ConfigError
from gpufleet.core.ledger import Ledger

__all__ = ["SrunBackend", "NodeWorker", "hostnames", "node_addr", "REQUEUE_MARK"]

REQUEUE_MARK = ".gpufleet-requeue"
NODE_LOST = "node_lost"  # ledger event: node, attempt, reason


@dataclass
class NodeWorker(Worker):
    ranks: list[int] | None = None
    node: str | None = None


def _slurm(argv: list[str], timeout: float = 15.0) -> str:
    from gpufleet.health.slurm import run_slurm

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


class SrunBackend:
    name = "srun"

    def __init__(
        self,
        standby: bool = False,
        nodes: int | None = None,
        min_nodes: int | None = None,
        nodelist: list[str] | None = None,
        srun: str = "srun",
        python: str | None = None,
        probe_timeout: float = 8.0,
        agent_grace_s: float = 5.0,
    ) -> None:
        del standby  # no standby interpreters across srun (each attempt is a new step)
        listed = nodelist or os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
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
        self.lost: list[str] = []
        self.active: list[str] = []
        self.srun = srun
        self.python = python or sys.executable
        self.probe_timeout = probe_timeout
        self.agent_grace_s = agent_grace_s
        self._run_dir: Path | None = None
        self._attempt = 0

    # -- Backend hooks ---------------------------------------------------------------------------
    def prepare(self, spec: LaunchSpec) -> None:
        return None

    def start(self, spec: LaunchSpec) -> list[Worker]:
        self.active = self.healthy[: self.want]
        spec.nnodes = len(self.active)
        spec.master_addr = node_addr(self.active[0])
        self._run_dir = Path(spec.env["GPUFLEET_RUN_DIR"])
        self._attempt = spec.attempt
        if spec.log_dir is None:
            spec.log_dir = str(self._run_dir / "logs")
        log_dir = Path(spec.log_dir) / f"attempt-{spec.attempt}"
        log_dir.mkdir(parents=True, exist_ok=True)
        workers: list[Worker] = []
        for i, node in enumerate(self.active):
            sub = replace(spec, node_rank=i)
            env = {
                **os.environ,
                **spec.env,
                "GPUFLEET_AGENT_SPEC": json.dumps(asdict(sub)),
                "GPUFLEET_AGENT_GRACE": str(self.agent_grace_s),
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
            ranks = list(range(first, first + spec.nproc_per_node))
            workers.append(NodeWorker(first, proc, r, ranks=ranks, node=node))
        return workers

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
            "gpufleet.cli.agent",
        ]

    def stop(self, workers: list[Worker], grace_s: float) -> None:
        """SIGTERM each srun (it forwards to the agent, which stops its ranks); SIGKILL what is left."""
        for w in workers:
            _signal(w.proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s + self.agent_grace_s
        for w in workers:
            try:
                w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for w in workers:
            if w.proc.poll() is None:
                _signal(w.proc, signal.SIGKILL)
                w.proc.wait()

    def close(self) -> None:
        return None

    # -- node loss -------------------------------------------------------------------------------
    def probe(self, node: str) -> bool:
        """True when ``node``'s slurmd still launches a step (a trivial ``true``) in time."""
        argv = [self.srun, "--nodes=1", "--ntasks=1", f"--nodelist={node}", "--overlap", "true"]
        try:
            p = subprocess.run(
                argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=self.probe_timeout, check=False
            )
        except subprocess.TimeoutExpired:
            return False
        return p.returncode == 0

    def after_failure(self, workers: list[Worker], ledger: Ledger, attempt: int) -> str | None:
        """Isolate lost nodes; None to restart on the healthy ones, else why the job must requeue."""
        from gpufleet.cli.agent import report_dir

        rdir = report_dir(self._run_dir or ".", attempt)
        silent = [
            str(getattr(w, "node", ""))
            for w in workers
            if getattr(w, "node", None) and not (rdir / f"{getattr(w, 'node', '')}.exit.json").exists()
        ]
        lost = [n for n in silent if not self.probe(n)]
        for node in lost:
            reason = f"agent vanished in attempt {attempt} and srun probe failed"
            job = os.environ.get("SLURM_JOB_ID")
            ledger.emit(NODE_LOST, node=node, attempt=attempt, reason=reason, job=job)
            self._isolate(node, reason, ledger)
            self.healthy.remove(node)
            self.lost.append(node)
        if len(self.healthy) >= self.min_nodes:
            return None
        if self._run_dir is not None:
            (self._run_dir / REQUEUE_MARK).write_text(json.dumps({"lost": self.lost, "t": time.time()}))
        return (
            f"{len(self.healthy)} healthy node(s) left of {len(self.all_nodes)}, need {self.min_nodes}: "
            f"requeue without {','.join(self.lost)}"
        )

    def _isolate(self, node: str, reason: str, ledger: Ledger) -> None:
        from gpufleet.health.nodes import record_state
        from gpufleet.health.slurm import SlurmActions, SlurmError

        record_state(node, "suspect", reason, component="host", check="node-lost")
        try:
            SlurmActions(sink=ledger).drain(node, "node-lost", reason, component="host")
        except SlurmError as e:
            ledger.emit("slurm_action_failed", node=node, action="drain", error=str(e))
            print(f"gpufleet: could not drain {node}: {e}", file=sys.stderr)


def _signal(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass

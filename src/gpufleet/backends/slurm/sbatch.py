"""``gpufleet run --backend slurm``: write a readable sbatch script and submit it (:class:`SlurmSubmitter`).

The script runs the same supervisor inside the allocation with the srun backend (one agent per node,
see :mod:`gpufleet.backends.slurm.srun`). Choices, each for a reason:

- ``--requeue``: a job whose batch node dies is requeued by Slurm itself.
- ``--no-kill``: when another node of the allocation fails, Slurm keeps the job and the supervisor
  restarts on the healthy nodes (spares first) instead of losing the allocation.
- ``--signal=B:USR1@<s>``: before the time limit the batch shell gets USR1 and passes it to the
  supervisor, which asks every rank for a final checkpoint; the script then requeues the job so it
  continues from that checkpoint.
- ``--exclude``: nodes the node state log says to keep off (down or lemons) plus the user's own.
- Output under the run directory, appended across requeues.

The supervisor leaves ``RUN_DIR/.gpufleet-requeue`` when too few healthy nodes remain; the script
then requeues the job (the lost nodes are drained, so the scheduler places it elsewhere).
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

from gpufleet.backends.base import Submitter
from gpufleet.backends.slurm.srun import REQUEUE_MARK
from gpufleet.core.errors import ConfigError, UsageError

__all__ = [
    "SlurmSubmitter",
    "SbatchSpec",
    "Submission",
    "submit_batch",
    "render_sbatch",
    "time_limit_s",
    "write_sbatch",
    "submit",
    "exclusions",
    "parse_jobid",
]

_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")


@dataclass
class SbatchSpec:
    command: list[str]  # the training command
    run_dir: str
    nodes: int = 1
    spare_nodes: int = 0
    min_nodes: int | None = None
    nproc_per_node: int = 1
    partition: str | None = None
    time: str | None = None  # Slurm time: MM, HH:MM:SS, D-HH:MM
    job_name: str = "gpufleet"
    exclude: list[str] = field(default_factory=list)
    signal_s: int = 120
    supervisor_flags: list[str] = field(default_factory=list)  # passed to the inner `gpufleet run`
    sbatch_args: list[str] = field(default_factory=list)  # extra raw #SBATCH options
    python: str = field(default_factory=lambda: sys.executable)
    workdir: str = field(default_factory=os.getcwd)

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.spare_nodes < 0 or self.nproc_per_node < 1:
            raise ConfigError("--nodes and --nproc-per-node must be >= 1, --spare-nodes >= 0")
        if self.min_nodes is not None and not 1 <= self.min_nodes <= self.nodes:
            raise ConfigError(f"--min-nodes must be between 1 and --nodes ({self.nodes})")
        if self.time is not None and not _TIME.match(self.time):
            raise ConfigError(f"bad --time {self.time!r}; Slurm forms: MM, HH:MM:SS, D-HH:MM")
        if self.time is not None and time_limit_s(self.time) <= self.signal_s:
            # USR1 would come at once on every (re)start: a requeue loop that never trains.
            raise ConfigError(
                f"--time {self.time} must be longer than the {self.signal_s} s final-checkpoint warning"
            )
        if not self.command:
            raise ConfigError("no training command given (put it after --)")

    @property
    def script_path(self) -> Path:
        return Path(self.run_dir) / "job.sbatch"


@dataclass(frozen=True)
class Submission:
    script: Path
    job_id: str | None  # None: written only (dry run)


def submit_batch(spec: SbatchSpec, dry_run: bool = False, fleet: str | None = None) -> Submission:
    """Keep the job off the nodes to avoid (:func:`exclusions`), write its script, and submit it."""
    spec = replace(spec, exclude=exclusions(spec.exclude, fleet))
    path = write_sbatch(spec)
    return Submission(path, None if dry_run else submit(path))


def time_limit_s(value: str) -> int:
    """Seconds in a Slurm time limit: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS."""
    days, _, rest = value.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:  # after a day count the first field is hours
        h, m, sec = (parts + [0, 0])[:3]
    elif len(parts) == 3:
        h, m, sec = parts
    else:  # MM or MM:SS
        h, m, sec = 0, parts[0], (parts + [0])[1]
    return (int(days or 0) * 24 + h) * 3600 + m * 60 + sec


def render_sbatch(spec: SbatchSpec) -> str:
    run_dir = str(Path(spec.run_dir).resolve())
    q = shlex.quote
    total = spec.nodes + spec.spare_nodes
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={spec.job_name}",
        f"#SBATCH --nodes={total}",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --requeue",
        "#SBATCH --no-kill",
        f"#SBATCH --signal=B:USR1@{spec.signal_s}",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={run_dir}/slurm-%j.out",
        f"#SBATCH --chdir={spec.workdir}",
    ]
    if spec.partition:
        lines.append(f"#SBATCH --partition={spec.partition}")
    if spec.time:
        lines.append(f"#SBATCH --time={spec.time}")
    if spec.exclude:
        lines.append(f"#SBATCH --exclude={','.join(sorted(set(spec.exclude)))}")
    lines += [f"#SBATCH {a}" for a in spec.sbatch_args]
    inner = [
        spec.python,
        "-m",
        "gpufleet.cli.main",
        "run",
        "--backend",
        "srun",
        "--nodes",
        str(spec.nodes),
        "--min-nodes",
        str(spec.min_nodes or spec.nodes),
        "--nproc-per-node",
        str(spec.nproc_per_node),
        "--run-dir",
        run_dir,
        "--no-progress",
        *spec.supervisor_flags,
        "--",
        *spec.command,
    ]
    mark = f"{run_dir}/{REQUEUE_MARK}"
    body = f"""
# Generated by `gpufleet run --backend slurm`; see docs/slurm.md. The supervisor runs in here and
# starts one gpufleet agent per node with srun; it restarts on healthy nodes when one is lost.
set -u
timelimit=0
rm -f {q(mark)}   # a mark left by a run that was killed before acting on it is stale
trap 'timelimit=1; kill -USR1 "$pid" 2>/dev/null' USR1   # time limit near: final checkpoint
trap 'kill -TERM "$pid" 2>/dev/null' TERM                 # scancel: stop, no requeue
{" ".join(q(a) for a in inner)} &
pid=$!
while :; do
  wait "$pid"; rc=$?
  kill -0 "$pid" 2>/dev/null || break   # wait returned for a trapped signal: keep waiting
done
if [ "$timelimit" = 1 ] || [ -e {q(mark)} ]; then
  rm -f {q(mark)}
  echo "gpufleet: requeueing job $SLURM_JOB_ID (rc=$rc, time limit=$timelimit)" >&2
  scontrol requeue "$SLURM_JOB_ID"
fi
exit "$rc"
"""
    return "\n".join(lines) + "\n" + body


def write_sbatch(spec: SbatchSpec) -> Path:
    path = spec.script_path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_sbatch(spec))
    return path


def parse_jobid(out: str) -> str:
    """``sbatch --parsable`` prints ``JOBID`` or ``JOBID;CLUSTER``."""
    first = out.strip().splitlines()[-1] if out.strip() else ""
    jobid = first.split(";")[0]
    if not jobid.isdigit():
        raise UsageError(f"sbatch gave no job id: {out.strip()[:200]!r}")
    return jobid


def submit(path: str | os.PathLike[str], timeout: float = 30.0) -> str:
    """Submit the script with ``sbatch --parsable``; returns the job id."""
    from gpufleet.backends.slurm.actions import SlurmError, run_slurm

    try:
        return parse_jobid(run_slurm(["sbatch", "--parsable", str(path)], timeout))
    except SlurmError as e:
        raise UsageError(f"sbatch failed: {e}") from None


def exclusions(extra: Sequence[str] = (), fleet: str | None = None) -> list[str]:
    """Nodes to keep the job off: the node state log's exclude list plus ``extra``.

    When Slurm answers, names it does not know are dropped (sbatch rejects unknown nodes).
    """
    from gpufleet.backends.slurm.actions import SlurmError, cluster_nodes
    from gpufleet.health.nodes import exclude_list

    names = set(exclude_list(fleet)) | {n for n in extra if n}
    try:
        known = {n.name for n in cluster_nodes(timeout=10.0)}
    except SlurmError:
        return sorted(names)
    return sorted(names & known)


@dataclass(frozen=True, slots=True)
class SlurmSubmitter(Submitter):
    """``gpufleet run --backend slurm``: the batch job's own flags; its supervisor runs on ``srun``."""

    inner: ClassVar[str] = "srun"

    nodes: int
    """Nodes to train on (``--nodes``)."""
    spare_nodes: int
    """Extra nodes allocated as hot spares for a lost node."""
    min_nodes: int | None
    """Go on with fewer nodes down to this; else requeue."""
    partition: str | None
    """The Slurm partition."""
    time_limit: str | None
    """The Slurm time limit (``--time``)."""
    exclude: tuple[str, ...]
    """Nodes to avoid, besides the node state log's."""
    job_name: str
    """The Slurm job name."""
    submit_job: bool
    """Submit (``--submit``), or only write ``RUN_DIR/job.sbatch`` (``--dry-run``)."""

    @classmethod
    def from_flags(cls, flags: Mapping[str, Any]) -> SlurmSubmitter:
        return cls(
            nodes=flags["nodes"] or 1,
            spare_nodes=flags["spare_nodes"],
            min_nodes=flags["min_nodes"],
            partition=flags["partition"],
            time_limit=flags["time_limit"],
            exclude=tuple(flags["exclude"] or ()),
            job_name=flags["job_name"],
            submit_job=flags["submit"],
        )

    def submit(
        self, command: list[str], nproc_per_node: int, run_dir: str, supervisor_flags: list[str]
    ) -> int:
        spec = SbatchSpec(
            command=command,
            run_dir=run_dir,
            nodes=self.nodes,
            spare_nodes=self.spare_nodes,
            min_nodes=self.min_nodes,
            nproc_per_node=nproc_per_node,
            partition=self.partition,
            time=self.time_limit,
            job_name=self.job_name,
            exclude=list(self.exclude),  # submit_batch adds the node state log's
            supervisor_flags=supervisor_flags,
        )
        sub = submit_batch(spec, dry_run=not self.submit_job)
        if sub.job_id is None:
            print(f"gpufleet: wrote {sub.script} (not submitted; sbatch {sub.script})", file=sys.stderr)
            return 0
        print(sub.job_id)
        print(
            f"gpufleet: submitted job {sub.job_id} ({sub.script}); see `gpufleet report {spec.run_dir}`",
            file=sys.stderr,
        )
        return 0

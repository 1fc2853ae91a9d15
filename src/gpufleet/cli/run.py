"""``gpufleet run``: supervise a training command on this host, or submit it to Slurm (docs/slurm.md).

Flags -> :class:`RunRequest` (typed, validated in full before anything starts) -> the supervisor or
the Slurm submission -> one summary line. A bad value is one line on stderr and exit code 2.
"""

from __future__ import annotations

import atexit
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from gpufleet.backends.base import Submitter
    from gpufleet.observe.exporter import Listen
    from gpufleet.train.settings import SupervisorConfig
    from gpufleet.train.supervisor import Outcome

__all__ = ["register", "RunRequest"]

_HELP = (
    "Run COMMAND (after --) as N supervised workers; restart on crash, hang or loss spike.\n\n"
    "COMMAND is a plain training script that calls gpufleet.init(). Every flag is checked before a "
    "worker starts.\n\n"
    "Exit codes: 0 done (or stopped cleanly), 1 failed, 2 bad flags or settings (also when a worker "
    "rejects its settings), 3 no checkpoint progress, 4 restart budget used up, 5 rollback budget used up."
    "\n\nExamples:\n\n"
    "  gpufleet run -n 2 --checkpoint-every auto -- python train.py\n\n"
    "  gpufleet run -n 2 --inject kill:rank=1,step=40 -- python train.py\n\n"
    "  gpufleet run --backend slurm --nodes 2 -n 8 --partition gpu -- python train.py"
)


def register(app: typer.Typer) -> None:
    app.command(
        "run",
        context_settings={"allow_extra_args": True, "ignore_unknown_options": False},
        no_args_is_help=True,
        help=_HELP,
        options_metavar="[OPTIONS] -- COMMAND [ARGS]...",
    )(run_command)


@dataclass(frozen=True)
class RunRequest:
    """What ``gpufleet run`` was asked to do. Building one validates every flag (ConfigError)."""

    config: SupervisorConfig  # for a batch submission: the supervisor that will run inside the job
    submitter: Submitter | None = None  # --backend slurm or k8s: the batch job to write and submit
    metrics: Listen | None = None  # --metrics: serve this run's Prometheus metrics while it runs

    @classmethod
    def from_flags(cls, p: Mapping[str, Any], command: list[str], *, tty: bool) -> RunRequest:
        """``p``: the command's parameters by name; ``tty``: whether the live view would be on by default."""
        from gpufleet.backends import BACKENDS, backend_class, submitter_class
        from gpufleet.train.settings import SupervisorConfig

        # not a backend: a batch submission, or else an error that lists every choice
        submitter_cls = submitter_class(p["backend"]) if p["backend"] not in BACKENDS else None
        # a batch submission's supervisor runs inside the job, on the submitter's inner backend
        backend = submitter_cls.inner if submitter_cls is not None else p["backend"]
        options = backend_class(backend).options(p)
        config = SupervisorConfig(
            command=command,
            nproc=p["nproc_per_node"],
            run_dir=p["run_dir"],
            backend=backend,
            max_restarts=p["max_restarts"],
            restart_window=p["restart_window"],
            max_no_progress=p["max_no_progress"],
            max_rollbacks=p["max_rollbacks"],
            rollback_window=p["rollback_window"],
            inject=list(p["inject"] or ()),
            hang_timeout_floor=p["hang_timeout"],
            init_timeout=p["init_timeout"],
            checkpoint_every=p["checkpoint_every"],
            keep_last=p["keep_last"],
            upload_url=p["upload"],
            s3_endpoint=p["s3_endpoint"],
            mtbf_s=p["mtbf"],
            memory_tier=p["memory_tier"],
            dist_backend=p["dist_backend"],
            standby=p["standby"],
            auto_telemetry=p["auto_telemetry"],
            progress=tty if p["progress"] is None else p["progress"],
            backend_options=options,
            cpu_affinity=p["cpu_affinity"],
            min_nproc=p["min_nproc"],
            slot_failures=p["slot_failures"],
            in_process_restart=p["in_process_restart"],
            straggler_action=p["straggler_action"],
        )
        metrics = None
        if p.get("metrics") is not None:
            from gpufleet.observe.exporter import parse_listen

            metrics = parse_listen(p["metrics"])
        submitter = submitter_cls.from_flags(p) if submitter_cls is not None else None
        return cls(config=config, submitter=submitter, metrics=metrics)


def run_command(
    ctx: typer.Context,
    nproc_per_node: Annotated[
        int, typer.Option("--nproc-per-node", "-n", help="Worker processes per node (this host, each node).")
    ] = 1,
    run_dir: Annotated[
        str, typer.Option(help="Run directory: ledger, checkpoints, logs, report.")
    ] = "runs/default",
    backend: Annotated[
        str,
        typer.Option(
            help="Where workers run: local, slurm (submit a batch job), srun (inside one), "
            "ray (--address; --nodes Ray nodes, same world size on fewer after a loss), k8s (--image)."
        ),
    ] = "local",
    max_restarts: Annotated[
        int, typer.Option(help="Restarts allowed within --restart-window steps (exit 4 beyond).")
    ] = 10,
    restart_window: Annotated[
        int, typer.Option(help="Steps over which --max-restarts counts (0: the whole run).")
    ] = 1000,
    max_no_progress: Annotated[
        int,
        typer.Option(help="Stop (exit 3) after this many consecutive restarts without a newer checkpoint."),
    ] = 3,
    max_rollbacks: Annotated[
        int, typer.Option(help="Loss-spike rollbacks allowed within --rollback-window steps (exit 5 beyond).")
    ] = 3,
    rollback_window: Annotated[
        int, typer.Option(help="Steps over which --max-rollbacks counts (0: the whole run).")
    ] = 1000,
    inject: Annotated[
        list[str] | None,
        typer.Option(help="Fault drill, repeatable: kill:rank=1,step=40 | hang:... | nan:step=N ..."),
    ] = None,
    checkpoint_every: Annotated[
        str | None,
        typer.Option(help="N or Nsteps, a time (90s, 5m, 1h), or auto (Young/Daly). Default: the script's."),
    ] = None,
    keep_last: Annotated[
        int | None, typer.Option(help="Checkpoints to keep, >= 1. Default: the script's, else 3.")
    ] = None,
    upload: Annotated[
        str | None, typer.Option(help="s3://bucket/prefix: tiered copy of every checkpoint.")
    ] = None,
    s3_endpoint: Annotated[
        str | None, typer.Option(help="S3-compatible endpoint URL (http:// or https://).")
    ] = None,
    mtbf: Annotated[
        float | None, typer.Option(help="Assumed MTBF in seconds (> 0) for --checkpoint-every auto.")
    ] = None,
    memory_tier: Annotated[
        str | None,
        typer.Option(
            metavar="SIZE",
            help="Keep committed checkpoints in host memory too (/dev/shm), within SIZE (2GiB; 0: off); "
            "restore tries memory before disk (docs/checkpoints.md).",
        ),
    ] = None,
    hang_timeout: Annotated[
        float, typer.Option(help="Floor of the auto-calibrated hang timeout, seconds.")
    ] = 60.0,
    init_timeout: Annotated[
        float, typer.Option(help="Seconds a worker may take to start and restore.")
    ] = 300.0,
    standby: Annotated[bool, typer.Option(help="Pre-spawn standby interpreters to cut restart time.")] = True,
    auto_telemetry: Annotated[
        bool,
        typer.Option(
            help="Report each optimizer step of a script that does not call gpufleet.init() "
            "(heartbeats, steps, torch.save checkpoints; docs/telemetry.md)."
        ),
    ] = True,
    cpu_affinity: Annotated[
        str,
        typer.Option(
            help="CPUs per worker: none (inherit), auto (a block each, NUMA-local), numa (its NUMA node), "
            "or one CPU list per local rank, ':'-separated (0-3:4-7). Threads default to each worker's "
            "share of the CPUs unless OMP_NUM_THREADS is set."
        ),
    ] = "none",
    dist_backend: Annotated[
        str | None,
        typer.Option(
            metavar="auto|nccl|gloo",
            help="torch.distributed backend. auto (default): NCCL for CUDA tensors and gloo for CPU ones "
            "where there are GPUs (one per rank), gloo otherwise; gloo: ranks may share a GPU.",
        ),
    ] = None,
    min_nproc: Annotated[
        int | None,
        typer.Option(help="local: after repeated failures of one worker slot, go on with fewer, to this."),
    ] = None,
    slot_failures: Annotated[
        int, typer.Option(help="local, with --min-nproc: consecutive failures of one slot that drop it.")
    ] = 2,
    in_process_restart: Annotated[
        bool,
        typer.Option(
            help="local: when a rank crashes or hangs, the other ranks keep their processes and rejoin "
            "with a replacement (a new rendezvous round), instead of every rank restarting. Falls back "
            'to a full restart where unsafe (docs/reliability.md, "In-process restart").',
        ),
    ] = False,
    straggler_action: Annotated[
        str,
        typer.Option(
            metavar="record|restart",
            help="What a persistent straggler rank triggers: record (the ledger and report say so) or "
            "restart (a failure: the fast restart path; the srun/Slurm backend drains its node and "
            "lowers its reputation in the fleet ledger).",
        ),
    ] = "record",
    progress: Annotated[
        bool | None, typer.Option(help="Live progress view (default: when stderr is a TTY).")
    ] = None,
    metrics: Annotated[
        str | None,
        typer.Option(
            metavar="[ADDR:]PORT",
            help="Serve this run's Prometheus metrics at http://ADDR:PORT/metrics while it runs "
            "(ADDR defaults to 127.0.0.1; docs/observability.md).",
        ),
    ] = None,
    nodes: Annotated[int | None, typer.Option(min=1, help="slurm/srun/ray: nodes to train on.")] = None,
    spare_nodes: Annotated[
        int, typer.Option(min=0, help="slurm: extra nodes allocated as hot spares for a lost node.")
    ] = 0,
    min_nodes: Annotated[
        int | None,
        typer.Option(min=1, help="slurm/srun/ray: go on with fewer nodes down to this; else requeue."),
    ] = None,
    partition: Annotated[str | None, typer.Option(help="slurm: partition.")] = None,
    time_limit: Annotated[str | None, typer.Option("--time", help="slurm: time limit (HH:MM:SS).")] = None,
    exclude: Annotated[
        list[str] | None, typer.Option(help="slurm: nodes to avoid, besides the node state log's.")
    ] = None,
    job_name: Annotated[str, typer.Option(help="slurm: job name.")] = "gpufleet",
    submit: Annotated[
        bool,
        typer.Option("--submit/--dry-run", help="slurm/k8s: submit, or only write RUN_DIR/job.sbatch (k8s/)"),
    ] = True,
    address: Annotated[
        str | None, typer.Option(help="ray: the cluster's address, HOST:PORT (default: $RAY_ADDRESS, auto).")
    ] = None,
    image: Annotated[str | None, typer.Option(help="k8s: image with gpufleet and the training code.")] = None,
    namespace: Annotated[str, typer.Option(help="k8s: namespace of the run's objects.")] = "default",
    run_claim: Annotated[
        str | None, typer.Option(help="k8s: ReadWriteMany PVC for the run directory (else use --upload).")
    ] = None,
) -> int:
    from gpufleet.core.paths import output_dir

    request = RunRequest.from_flags(ctx.params, list(ctx.args), tty=sys.stderr.isatty())
    output_dir(request.config.run_dir, "--run-dir")
    if request.submitter is not None:
        cfg = request.config
        return request.submitter.submit(list(cfg.command), cfg.nproc, cfg.run_dir, _supervisor_flags(ctx))
    from gpufleet.train.supervisor import Supervisor

    if request.config.worker.memory_tier:  # the keeper outlives every worker, not the run
        from gpufleet.checkpoint.storage.memory import release

        cfg = request.config
        atexit.register(release, cfg.worker.checkpoint_dir or f"{cfg.run_dir}/checkpoints")
    if request.metrics is None:
        return _render(Supervisor(request.config).run())
    from gpufleet.observe.exporter import live

    with live(request.config.run_dir, request.metrics) as exporter:  # reads the ledger at each scrape
        print(f"gpufleet: serving metrics on {exporter.url}", file=sys.stderr, flush=True)
        return _render(Supervisor(request.config).run())


def _render(outcome: Outcome) -> int:
    if outcome.status == "config_error":
        print(f"gpufleet: error: a worker rejected its settings: {outcome.detail}", file=sys.stderr)
    else:
        print(
            f"gpufleet: run {outcome.status} after {outcome.restarts} restart(s); "
            f"see `gpufleet report {outcome.run_dir}`",
            file=sys.stderr,
        )
    return outcome.exit_code


# Options that describe the batch job (Slurm, Kubernetes) itself, not the supervisor that runs inside it.
_JOB_OPTIONS = {
    "nproc_per_node",
    "run_dir",
    "backend",
    "nodes",
    "spare_nodes",
    "min_nodes",
    "partition",
    "time_limit",
    "exclude",
    "job_name",
    "submit",
    "progress",
    "address",
    "image",
    "namespace",
    "run_claim",
}


def _supervisor_flags(ctx: typer.Context) -> list[str]:
    """The supervisor flags the user set, re-spelled for the `gpufleet run` inside the batch job."""
    out: list[str] = []
    for p in ctx.command.params:
        if p.name in _JOB_OPTIONS or p.name is None or not p.opts:
            continue
        value = ctx.params.get(p.name)
        if value == p.default or value is None:
            continue
        if isinstance(value, bool):
            flag = p.opts[0] if value else (p.secondary_opts or [None])[0]  # type: ignore[attr-defined]
            if flag:
                out.append(flag)
        elif isinstance(value, list | tuple):
            for v in value:
                out += [p.opts[0], str(v)]
        else:
            out += [p.opts[0], str(value)]
    return out

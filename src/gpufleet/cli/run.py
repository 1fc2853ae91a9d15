"""``gpufleet run``: supervise a training command on this host, or submit it to Slurm (docs/slurm.md).

Flags -> :class:`RunRequest` (typed, validated in full before anything starts) -> the supervisor or
the Slurm submission -> one summary line. A bad value is one line on stderr and exit code 2.
"""

from __future__ import annotations

import atexit
import gc
import os
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from typer.core import TyperCommand

from gpufleet.core.errors import ConfigError

if TYPE_CHECKING:
    from gpufleet.backends.base import Submitter
    from gpufleet.observe.exporter import Listen
    from gpufleet.train.settings import SupervisorConfig
    from gpufleet.train.supervisor import Outcome

__all__ = ["register", "RunRequest", "TorchrunLaunch", "torchrun_launch", "launch_env", "script_command"]

_HELP = (
    "Run COMMAND (after --) as N supervised workers; restart on crash, hang or loss spike.\n\n"
    "COMMAND is a plain training script that calls gpufleet.init(). Every flag is checked before a "
    "worker starts.\n\n"
    "Exit codes: 0 done (or stopped cleanly), 1 failed, 2 bad flags or settings (also when a worker "
    "rejects its settings, and the same command on a --run-dir that finished: nothing to train), "
    "3 no checkpoint progress, 4 restart budget used up, 5 rollback budget used up."
    "\n\nExamples:\n\n"
    "  gpufleet run -n 2 --checkpoint-every auto -- python train.py\n\n"
    "  gpufleet run --nproc-per-node 2 --standalone train.py --lr 3e-4\n\n"
    "  gpufleet run -n 2 --inject kill:rank=1,step=40 -- python train.py\n\n"
    "  gpufleet run -n 2 --run-dir runs/a --fresh -- python train.py --lr 3e-4\n\n"
    "  gpufleet run --backend slurm --nodes 2 -n 8 --partition gpu -- python train.py"
)


def register(app: typer.Typer) -> None:
    app.command(
        "run",
        cls=_RunCommand,
        # Options end at the first argument that is not one (torchrun's `train.py --its-flags`).
        context_settings={
            "allow_extra_args": True,
            "ignore_unknown_options": False,
            "allow_interspersed_args": False,
        },
        no_args_is_help=True,
        help=_HELP,
        options_metavar="[OPTIONS] [--] COMMAND | SCRIPT.py | -m MODULE [ARGS]...",
    )(run_command)


class _RunCommand(TyperCommand):
    """``gpufleet run``: ``-m MODULE ARGS...`` (torchrun's form) ends the options, as ``--`` does."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        return super().parse_args(ctx, _module_form(self, args))


def _module_form(command: Any, args: list[str]) -> list[str]:
    """``[OPTIONS] -m MOD ARGS...`` -> ``[OPTIONS] -- PYTHON -m MOD ARGS...``: MOD's arguments are its own."""
    takes_value = {
        o
        for p in command.params
        if p.param_type_name == "option" and not getattr(p, "is_flag", False)
        for o in p.opts
    }
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--" or not arg.startswith("-"):
            return args  # the command starts here: its -m is its own
        if arg in ("-m", "--module"):
            return [*args[:i], "--", sys.executable, "-m", *args[i + 1 :]]
        i += 2 if arg in takes_value else 1
    return args


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
        launch = torchrun_launch(p)
        env = launch_env(p)
        p = {**p, "nodes": launch.nodes, "min_nodes": launch.min_nodes}
        command = script_command(command, p["backend"])
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
            master_addr=launch.master_addr,
            master_port=launch.master_port,
            rdzv_id=p["rdzv_id"],
            env=env,
        )
        metrics = None
        if p.get("metrics") is not None:
            from gpufleet.observe.exporter import parse_listen

            metrics = parse_listen(p["metrics"])
        submitter = submitter_cls.from_flags(p) if submitter_cls is not None else None
        return cls(config=config, submitter=submitter, metrics=metrics)


# -------------------------------------------------------------------------- torchrun's launch line
_ON_ITS_OWN = ("ray", "k8s", "k8s-jobs")  # backends that choose the rendezvous address and port
_MANY_NODES = "--backend srun, slurm, ray or k8s"


@dataclass(frozen=True)
class TorchrunLaunch:
    """What torchrun's flags ask of gpufleet, checked against the backend."""

    nodes: int | None
    min_nodes: int | None
    master_addr: str | None
    master_port: int | None


def _count(text: str, what: str) -> int:
    n = int(text) if text.isdigit() else 0  # digits only: no sign, no spaces
    if n < 1:
        raise ConfigError(f"--nnodes {what!r}: expected N or MIN:MAX (positive integers)")
    return n


def torchrun_launch(p: Mapping[str, Any]) -> TorchrunLaunch:
    """torchrun's flags in ``p`` (``gpufleet run``'s parameters) for ``p["backend"]``: each is honoured
    or refused (ConfigError), never ignored (docs/torchrun.md)."""
    backend = p["backend"]
    nodes, min_nodes = p.get("nodes"), p.get("min_nodes")
    if p.get("nnodes") is not None:
        text = p["nnodes"]
        low, sep, high = text.partition(":")
        lo = _count(low, text)
        hi = _count(high, text) if sep else lo
        if lo > hi:
            raise ConfigError(f"--nnodes {text}: MIN is more than MAX")
        if backend == "local":
            if hi != 1:
                raise ConfigError(
                    f"--nnodes {text}: the local backend runs one node (this host); for several nodes use "
                    f"{_MANY_NODES}, which start every node's ranks"
                )
        else:
            if nodes is not None and nodes != hi:
                raise ConfigError(f"--nnodes {text} and --nodes {nodes} disagree")
            if min_nodes is not None and lo != hi and min_nodes != lo:
                raise ConfigError(f"--nnodes {text} and --min-nodes {min_nodes} disagree")
            nodes = hi
            min_nodes = lo if lo != hi else min_nodes
    if p.get("node_rank") not in (None, 0):
        raise ConfigError(
            f"--node-rank {p['node_rank']}: gpufleet starts every node's ranks from one `gpufleet run` "
            f"({_MANY_NODES}); run it once, not once per node"
        )
    rdzv = p.get("rdzv_backend")
    if rdzv is not None and rdzv not in ("c10d", "static"):
        raise ConfigError(
            f"--rdzv-backend {rdzv}: gpufleet's rendezvous is a c10d store it hosts itself; "
            "use c10d or static (or leave it out)"
        )
    addr, port = p.get("master_addr"), p.get("master_port")
    endpoint = p.get("rdzv_endpoint")
    if endpoint:
        host, sep, tail = endpoint.rpartition(":") if ":" in endpoint else (endpoint, "", "")
        end_port = None
        if sep:
            if not tail.isdigit() or not host:
                raise ConfigError(f"--rdzv-endpoint {endpoint!r}: expected HOST[:PORT]")
            end_port = int(tail)
        if addr is not None and addr != host:
            raise ConfigError(f"--rdzv-endpoint {endpoint} and --master-addr {addr} disagree")
        if port is not None and end_port is not None and port != end_port:
            raise ConfigError(f"--rdzv-endpoint {endpoint} and --master-port {port} disagree")
        addr, port = host, port if port is not None else end_port
    if p.get("standalone"):
        if backend != "local":
            raise ConfigError(
                f"--standalone runs one node on this host (the local backend), not --backend {backend}"
            )
        if addr is not None:
            raise ConfigError(
                "--standalone picks its rendezvous on this host; drop --rdzv-endpoint/--master-addr"
            )
    if backend != "local" and addr is not None:
        raise ConfigError(
            f"--master-addr/--rdzv-endpoint: the {backend} backend places the rendezvous on its first node"
        )
    if backend in _ON_ITS_OWN and port is not None:
        raise ConfigError(f"--master-port: the {backend} backend picks the rendezvous port on its first node")
    return TorchrunLaunch(nodes=nodes, min_nodes=min_nodes, master_addr=addr, master_port=port)


def launch_env(p: Mapping[str, Any]) -> dict[str, str]:
    """``--env-file`` then ``--env`` (a later one wins): the variables every rank gets. On the k8s
    backend they are written into manifests, so credential-looking names are refused there."""
    from gpufleet.backends.environ import credential_names, parse_env_file, parse_env_items

    env = parse_env_file(p["env_file"]) if p.get("env_file") else {}
    env.update(parse_env_items(p.get("env") or ()))
    secret = credential_names(env) if p["backend"] == "k8s" else []
    if secret:
        raise ConfigError(
            f"--env {secret[0]}: the k8s backend would write it into the manifests in clear text; "
            "give it to the pods through a Kubernetes Secret instead (docs/torchrun.md)"
        )
    return env


def script_command(command: list[str], backend: str) -> list[str]:
    """torchrun's ``SCRIPT.py ARGS...`` (or a file that is not executable) runs under Python: this
    interpreter where the ranks share this host's files (local, srun, slurm), else the nodes'
    ``python``. A missing script is a ConfigError before anything starts."""
    if not command:
        return command
    here = backend not in _ON_ITS_OWN
    first = command[0]
    path = Path(first)
    if first.endswith(".py") or (path.is_file() and not os.access(path, os.X_OK)):
        if here and not path.is_file():
            raise ConfigError(f"{first}: no such script")
        return [sys.executable if here else "python", *command]
    if here and shutil.which(first) is not None:
        from gpufleet.backends.local import python_entry

        entry = python_entry(command)
        if entry is not None and not entry[1] and not Path(entry[0][0]).is_file():
            raise ConfigError(f"{entry[0][0]}: no such script")
    return command


def run_command(
    ctx: typer.Context,
    nproc_per_node: Annotated[
        int,
        typer.Option(
            "--nproc-per-node",
            "--nproc_per_node",
            "-n",
            help="Worker processes per node (this host, each node).",
        ),
    ] = 1,
    run_dir: Annotated[
        str, typer.Option(help="Run directory: ledger, checkpoints, logs, report.")
    ] = "runs/default",
    fresh: Annotated[
        bool,
        typer.Option(
            help="Start over in --run-dir: move its previous run (ledger, checkpoints, logs) aside into "
            "RUN_DIR/previous-TIMESTAMP/, never deleting it. Without it, the same command on a finished "
            "run directory is refused (exit 2), and otherwise the run resumes (docs/supervisor.md)."
        ),
    ] = False,
    backend: Annotated[
        str,
        typer.Option(
            help="Where workers run: local, slurm (submit a batch job), srun (inside one), "
            "ray (--address; --nodes Ray nodes, same world size on fewer after a loss), k8s (--image)."
        ),
    ] = "local",
    max_restarts: Annotated[
        int,
        typer.Option(
            "--max-restarts",
            "--max_restarts",
            help="Restarts allowed within --restart-window steps (exit 4 beyond).",
        ),
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
    # -- torchrun's launch line (docs/torchrun.md), and the ranks' environment ---------------------
    nnodes: Annotated[
        str | None,
        typer.Option(
            "--nnodes",
            metavar="N|MIN:MAX",
            help="torchrun's: nodes (MIN:MAX: go on with MIN after a loss). local: 1 only; "
            "srun/slurm/ray/k8s: as --nodes (--min-nodes).",
        ),
    ] = None,
    node_rank: Annotated[
        int | None,
        typer.Option(
            "--node-rank",
            "--node_rank",
            help="torchrun's: 0 only. gpufleet starts every node's ranks from one `gpufleet run`.",
        ),
    ] = None,
    standalone: Annotated[
        bool,
        typer.Option(
            "--standalone", help="torchrun's: one node, a rendezvous on a free port here (the local backend)."
        ),
    ] = False,
    rdzv_backend: Annotated[
        str | None,
        typer.Option(
            "--rdzv-backend",
            "--rdzv_backend",
            metavar="c10d|static",
            help="torchrun's: c10d or static, both gpufleet's own c10d store (etcd is not supported).",
        ),
    ] = None,
    rdzv_endpoint: Annotated[
        str | None,
        typer.Option(
            "--rdzv-endpoint",
            "--rdzv_endpoint",
            metavar="HOST[:PORT]",
            help="torchrun's: local: the rendezvous store's address (as --master-addr/--master-port).",
        ),
    ] = None,
    rdzv_id: Annotated[
        str | None,
        typer.Option(
            "--rdzv-id", "--rdzv_id", help="torchrun's: the job id ranks see as TORCHELASTIC_RUN_ID."
        ),
    ] = None,
    master_addr: Annotated[
        str | None,
        typer.Option(
            "--master-addr",
            "--master_addr",
            help="local: the rendezvous address ranks see as MASTER_ADDR (default 127.0.0.1).",
        ),
    ] = None,
    master_port: Annotated[
        int | None,
        typer.Option(
            "--master-port",
            "--master_port",
            help="local, srun/slurm: the rendezvous port ranks see as MASTER_PORT (default: a free one).",
        ),
    ] = None,
    env: Annotated[
        list[str] | None,
        typer.Option(
            "--env",
            metavar="KEY=VALUE",
            help="A variable every rank gets, repeatable; wins over --env-file and the launching shell's.",
        ),
    ] = None,
    env_file: Annotated[
        str | None,
        typer.Option(
            "--env-file",
            metavar="PATH",
            help="KEY=VALUE lines (# comments) every rank gets; wins over the launching shell's.",
        ),
    ] = None,
) -> int:
    from gpufleet.core.paths import output_dir

    request = RunRequest.from_flags(ctx.params, list(ctx.args), tty=sys.stderr.isatty())
    output_dir(request.config.run_dir, "--run-dir")
    if fresh:  # here, not in a batch job: a requeued job must resume, never start over again
        from gpufleet.train.rundir import start_over

        print(f"gpufleet: {start_over(request.config)}", file=sys.stderr, flush=True)
    if request.submitter is not None:
        cfg = request.config
        flags = _supervisor_flags(ctx)
        if cfg.env and ctx.params["backend"] == "k8s":  # the supervisor pod's command line (no credential)
            flags += [f for k, v in cfg.env.items() for f in ("--env", f"{k}={v}")]
        elif cfg.env:  # sbatch hands the job its environment: the values stay out of the script
            os.environ.update(cfg.env)
        return request.submitter.submit(list(cfg.command), cfg.nproc, cfg.run_dir, flags)
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
    # The run is over: the interpreter's exit would otherwise collect every object that `import torch`
    # left here (the rendezvous store imports it), 1.5-1.9 s on 2 loaded cores; frozen, it skips them.
    gc.freeze()
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
    "fresh",
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
    # torchrun's flags become the job's shape (--nnodes: --nodes) or are checked here; --env and
    # --env-file reach the job as its environment (run_command)
    "nnodes",
    "node_rank",
    "standalone",
    "rdzv_backend",
    "rdzv_endpoint",
    "master_addr",
    "env",
    "env_file",
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

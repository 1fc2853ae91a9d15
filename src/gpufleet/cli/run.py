"""``gpufleet run``: supervise a training command on this host, or submit it to Slurm (docs/slurm.md)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

__all__ = ["register"]


def register(app: typer.Typer) -> None:
    app.command(
        "run",
        context_settings={"allow_extra_args": True, "ignore_unknown_options": False},
        no_args_is_help=True,
    )(run_command)


def run_command(
    ctx: typer.Context,
    nproc_per_node: Annotated[
        int, typer.Option("--nproc-per-node", "-n", help="Worker processes on this host.")
    ] = 1,
    run_dir: Annotated[
        str, typer.Option(help="Run directory: ledger, checkpoints, report.")
    ] = "runs/default",
    backend: Annotated[
        str, typer.Option(help="Where workers run: local, slurm (submit a batch job), srun (inside one).")
    ] = "local",
    max_restarts: Annotated[int, typer.Option(help="Restart budget before giving up (exit 4).")] = 10,
    max_no_progress: Annotated[
        int,
        typer.Option(help="Stop (exit 3) after this many consecutive restarts without a newer checkpoint."),
    ] = 3,
    max_rollbacks: Annotated[int, typer.Option(help="Loss-spike rollbacks allowed (exit 5 beyond).")] = 3,
    inject: Annotated[
        list[str] | None,
        typer.Option(help="Fault drill, repeatable: kill:rank=1,step=40 | hang:... | nan:step=N ..."),
    ] = None,
    checkpoint_every: Annotated[
        str | None, typer.Option(help="N (steps), 90s/5m, or auto (Young/Daly).")
    ] = None,
    keep_last: Annotated[int | None, typer.Option(help="Checkpoints to keep.")] = None,
    upload: Annotated[
        str | None, typer.Option(help="s3://bucket/prefix: tiered copy of every checkpoint.")
    ] = None,
    s3_endpoint: Annotated[str | None, typer.Option(help="S3-compatible endpoint URL.")] = None,
    mtbf: Annotated[
        float | None, typer.Option(help="Assumed MTBF in seconds for --checkpoint-every auto.")
    ] = None,
    hang_timeout: Annotated[
        float, typer.Option(help="Floor of the auto-calibrated hang timeout, seconds.")
    ] = 60.0,
    init_timeout: Annotated[
        float, typer.Option(help="Seconds a worker may take to start and restore.")
    ] = 300.0,
    standby: Annotated[bool, typer.Option(help="Pre-spawn standby interpreters to cut restart time.")] = True,
    progress: Annotated[
        bool | None, typer.Option(help="Live progress view (default: when stderr is a TTY).")
    ] = None,
    nodes: Annotated[int | None, typer.Option(help="slurm/srun: nodes to train on.")] = None,
    spare_nodes: Annotated[
        int, typer.Option(help="slurm: extra nodes allocated as hot spares for a lost node.")
    ] = 0,
    min_nodes: Annotated[
        int | None, typer.Option(help="slurm/srun: keep training on fewer nodes down to this; else requeue.")
    ] = None,
    partition: Annotated[str | None, typer.Option(help="slurm: partition.")] = None,
    time_limit: Annotated[str | None, typer.Option("--time", help="slurm: time limit (HH:MM:SS).")] = None,
    exclude: Annotated[
        list[str] | None, typer.Option(help="slurm: nodes to avoid, besides the node state log's.")
    ] = None,
    job_name: Annotated[str, typer.Option(help="slurm: job name.")] = "gpufleet",
    submit: Annotated[
        bool, typer.Option("--submit/--dry-run", help="slurm: submit, or only write RUN_DIR/job.sbatch.")
    ] = True,
) -> int:
    """Run COMMAND (after --) as N supervised workers; restart on crash, hang or loss spike.

    Example: gpufleet run -n 2 --inject kill:rank=1,step=40 -- python train.py
    """
    from gpufleet.core.errors import UsageError
    from gpufleet.train.supervisor import Supervisor, SupervisorConfig

    command = list(ctx.args)
    if not command:
        raise UsageError("no training command given; usage: gpufleet run [OPTIONS] -- python train.py ARGS")
    if backend == "slurm":
        return _submit_slurm(
            ctx, command, nodes=nodes or 1, spare_nodes=spare_nodes, min_nodes=min_nodes,
            nproc_per_node=nproc_per_node, run_dir=run_dir, partition=partition, time_limit=time_limit,
            exclude=list(exclude or []), job_name=job_name, submit=submit,
        )
    backend_options: dict[str, object] = {}
    if backend == "srun":
        backend_options = {"nodes": nodes, "min_nodes": min_nodes}
    cfg = SupervisorConfig(
        command=command,
        nproc=nproc_per_node,
        run_dir=run_dir,
        backend=backend,
        max_restarts=max_restarts,
        max_no_progress=max_no_progress,
        max_rollbacks=max_rollbacks,
        inject=list(inject or []),
        hang_timeout_floor=hang_timeout,
        init_timeout=init_timeout,
        checkpoint_every=checkpoint_every,
        keep_last=keep_last,
        upload_url=upload,
        s3_endpoint=s3_endpoint,
        mtbf_s=mtbf,
        standby=standby,
        progress=sys.stderr.isatty() if progress is None else progress,
        backend_options=backend_options,
    )
    outcome = Supervisor(cfg).run()
    print(
        f"gpufleet: run {outcome.status} after {outcome.restarts} restart(s); "
        f"see `gpufleet report {outcome.run_dir}`",
        file=sys.stderr,
    )
    return outcome.exit_code


# Options that describe the Slurm job itself, not the supervisor that runs inside it.
_JOB_OPTIONS = {
    "nproc_per_node", "run_dir", "backend", "nodes", "spare_nodes", "min_nodes", "partition",
    "time_limit", "exclude", "job_name", "submit", "progress",
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


def _submit_slurm(ctx: typer.Context, command: list[str], **kw: object) -> int:
    from gpufleet.backends.slurm import SbatchSpec, exclusions, submit, write_sbatch

    spec = SbatchSpec(
        command=command,
        run_dir=str(kw["run_dir"]),
        nodes=int(kw["nodes"]),  # type: ignore[call-overload]
        spare_nodes=int(kw["spare_nodes"]),  # type: ignore[call-overload]
        min_nodes=kw["min_nodes"],  # type: ignore[arg-type]
        nproc_per_node=int(kw["nproc_per_node"]),  # type: ignore[call-overload]
        partition=kw["partition"],  # type: ignore[arg-type]
        time=kw["time_limit"],  # type: ignore[arg-type]
        job_name=str(kw["job_name"]),
        exclude=exclusions(kw["exclude"]),  # type: ignore[arg-type]
        supervisor_flags=_supervisor_flags(ctx),
    )
    path = write_sbatch(spec)
    if not kw["submit"]:
        print(f"gpufleet: wrote {path} (not submitted; sbatch {path})", file=sys.stderr)
        return 0
    jobid = submit(path)
    print(jobid)
    print(f"gpufleet: submitted job {jobid} ({path}); see `gpufleet report {spec.run_dir}`", file=sys.stderr)
    return 0

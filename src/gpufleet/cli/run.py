"""``gpufleet run``: supervise a training command on this host (more backends to come)."""

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
    backend: Annotated[str, typer.Option(help="Where workers run: local.")] = "local",
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
) -> int:
    """Run COMMAND (after --) as N supervised workers; restart on crash, hang or loss spike.

    Example: gpufleet run -n 2 --inject kill:rank=1,step=40 -- python train.py
    """
    from gpufleet.core.errors import UsageError
    from gpufleet.train.supervisor import Supervisor, SupervisorConfig

    command = list(ctx.args)
    if not command:
        raise UsageError("no training command given; usage: gpufleet run [OPTIONS] -- python train.py ARGS")
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
    )
    outcome = Supervisor(cfg).run()
    print(
        f"gpufleet: run {outcome.status} after {outcome.restarts} restart(s); "
        f"see `gpufleet report {outcome.run_dir}`",
        file=sys.stderr,
    )
    return outcome.exit_code

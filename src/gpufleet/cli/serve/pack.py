"""``gpufleet serve pack``: place plans' engine instances into racks or nodes (docs/serve-pack.md).

``register(app)`` adds the command to the ``serve`` group. Thin: validates flags (one-line
UsageError, exit 2), calls :func:`gpufleet.serve.pack.pack`, renders. OR-Tools, Rich and
matplotlib load inside the command. An infeasible fleet is a PackInfeasible: one line, exit 1.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Annotated

import typer

from gpufleet.core.errors import UsageError

__all__ = ["register", "pack_command"]

Opt = typer.Option


def register(app: typer.Typer) -> None:
    app.command("pack")(pack_command)


def pack_command(
    plans: Annotated[
        list[Path] | None, Opt("--plans", help="Plan files from `serve plan` (--plans a.json b.json ...).")
    ] = None,
    more: Annotated[list[Path] | None, typer.Argument(help="More plan files.", show_default=False)] = None,
    racks: Annotated[
        str | None, Opt("--racks", help="TYPE:COUNT[@COST],... e.g. nvl72:4 (types: nvl72, nvl36, hgx8).")
    ] = None,
    nodes: Annotated[
        str | None, Opt("--nodes", help="GPUSxCOUNT[@COST] e.g. 8x16: 16 nodes of 8 GPUs.")
    ] = None,
    anti_affinity: Annotated[
        bool, Opt("--anti-affinity", help="Spread each workload's replicas over distinct domains.")
    ] = False,
    time_limit: Annotated[float, Opt("--time-limit", help="CP-SAT time limit in seconds.")] = 10.0,
    workers: Annotated[int, Opt("--workers", help="CP-SAT num_workers (fixed: deterministic).")] = 8,
    seed: Annotated[int, Opt("--seed", help="CP-SAT random seed.")] = 0,
    solver: Annotated[str, Opt("--solver", help="cp-sat | ffd (first-fit decreasing only).")] = "cp-sat",
    out: Annotated[Path, Opt("--out", help="Output folder: placement.json, racks.png.")] = Path("serve-pack"),
    no_plot: Annotated[bool, Opt("--no-plot", help="Do not write racks.png.")] = False,
    json_out: Annotated[bool, Opt("--json", help="Print placement.json to stdout, not tables.")] = False,
) -> int:
    """Pack several workloads' replicas into racks/nodes at the lowest cost (CP-SAT, FFD fallback)."""
    from gpufleet.serve.common.racks import build_fleet
    from gpufleet.serve.pack.plans import load_plans
    from gpufleet.serve.pack.solver import Solver, pack

    paths = [*(plans or []), *(more or [])]
    if not paths:
        raise UsageError("give at least one plan file: --plans a.json [b.json ...]")
    if not (math.isfinite(time_limit) and time_limit > 0):
        raise UsageError(f"--time-limit must be > 0 seconds (got {time_limit:g})")
    if not 1 <= workers <= 256:
        raise UsageError(f"--workers must be in 1..256 (got {workers})")
    if solver not in tuple(Solver):
        raise UsageError(f"unknown --solver {solver!r}; valid: {', '.join(Solver)}")
    fleet = build_fleet(racks, nodes)
    workloads = load_plans(paths)
    from gpufleet.core.paths import output_dir

    output_dir(out, "--out")

    from rich.console import Console

    err = Console(stderr=True)
    for w in workloads:
        if not w.feasible:
            err.print(
                f"[yellow]note:[/] plan {w.source} is marked infeasible (closest candidate); "
                "packing it anyway"
            )
    result = pack(
        workloads,
        fleet,
        anti_affinity=anti_affinity,
        time_limit=time_limit,
        workers=workers,
        seed=seed,
        solver=solver,
    )

    from gpufleet.serve.pack.render import headline, plot_racks, tables, write_json

    doc = result.to_json()
    written = [write_json(out / "placement.json", doc)]
    if not no_plot:
        try:
            written.append(plot_racks(result, out / "racks.png"))
        except ImportError:
            err.print(
                "[yellow]note:[/] matplotlib is not installed; racks.png skipped "
                "(pip install 'gpufleet[plot]')"
            )
    if json_out:
        typer.echo(json.dumps(doc, indent=2))
    else:
        con = Console()
        for t in tables(result):
            con.print(t)
    print(headline(result), file=sys.stderr)
    for n in result.notes:
        err.print(f"[yellow]note:[/] {n}")
    err.print("results: " + ", ".join(str(p) for p in written))
    return 0

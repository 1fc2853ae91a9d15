"""``gpufleet health ...``: the health pillar, one thin module per command group.

``check`` and ``watch`` (tiered node checks, passive watching), ``slurm-config`` (Slurm's
HealthCheckProgram, Prolog and Epilog), ``sweep`` and ``release`` (a Ray cluster's nodes, quarantine).
Each module imports only Typer at import time; the health libraries and the platforms' clients load
inside the commands.
"""

from __future__ import annotations

import typer

from gpufleet.cli.health import check, ray, slurm

__all__ = ["app"]

app = typer.Typer(
    name="health",
    help="Node health: tiered checks (quick / postfail / acceptance) and passive watching.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
for _group in (check, slurm, ray):
    _group.register(app)

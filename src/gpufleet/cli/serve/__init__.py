"""``gpufleet serve ...``: the serving pillar, one thin module per command group.

``bench`` (SLA benchmark), ``mock`` (mock OpenAI server), ``profile`` (latency profiles), ``plan``
(capacity planner) and ``pack`` (rack packer). Each module imports only Typer at import time; the
serving libraries load inside the commands.
"""

from __future__ import annotations

import typer

from gpufleet.cli.serve import bench, mock, pack, plan, profile

__all__ = ["app"]

app = typer.Typer(help="Serving: honest SLA benchmarks of OpenAI-compatible endpoints.", no_args_is_help=True)
for _group in (bench, mock, profile, plan, pack):
    _group.register(app)

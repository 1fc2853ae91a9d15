"""The plan file (docs/serve-plan.md): written by ``serve plan``, read by ``serve pack``.

Its schema name and version, and the closed set of deployment modes it names.
"""

from __future__ import annotations

import enum

__all__ = ["PLAN_SCHEMA", "PLAN_VERSION", "Mode"]

PLAN_SCHEMA = "gpufleet.serve.plan"
PLAN_VERSION = 1


class Mode(enum.StrEnum):
    """How a deployment serves: one engine does prefill and decode, or P/D-disaggregated engines."""

    AGGREGATED = "aggregated"
    DISAGGREGATED = "disaggregated"

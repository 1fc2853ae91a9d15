"""Process exit codes: every code gpufleet's processes exit with, in one place (docs/supervisor.md).

``gpufleet`` commands exit with 0-5 or 130. Workers under ``gpufleet run`` use 75 and 78 to tell the
supervisor why they stopped; the supervisor never passes those on (it turns 78 into 2).
``gpufleet health check`` follows the monitoring-plugin convention: 0 OK (WARN included), 1 a problem,
3 unknown (a check that could not run); ``CHECK_PROBLEM``/``CHECK_UNKNOWN`` name those values for health.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = ["ExitCode"]


class ExitCode(IntEnum):
    OK = 0
    """Done: the command completed, or the run stopped cleanly (SIGTERM/SIGINT with a final checkpoint)."""
    FAILED = 1
    """Failed for another reason (a non-restartable error, nodes lost, every request failed)."""
    USAGE = 2
    """Bad arguments, configuration or input; the message is one line on stderr."""
    NO_PROGRESS = 3
    """No-progress breaker: ``--max-no-progress`` consecutive restarts made no checkpoint progress."""
    MAX_RESTARTS = 4
    """Restart budget used up (``--max-restarts``)."""
    MAX_ROLLBACKS = 5
    """Rollback budget used up (``--max-rollbacks``)."""
    CHECK_PROBLEM = 1
    """``gpufleet health``: at least one check failed (the same value as FAILED; a WARN exits 0)."""
    CHECK_UNKNOWN = 3
    """``gpufleet health``: a check could not run, so nothing is known (the same value as NO_PROGRESS)."""
    INTERRUPTED = 130
    """Stopped by Ctrl-C before finishing (128 + SIGINT), where stopping is not a clean outcome."""
    WORKER_SPIKE = 75
    """Worker -> supervisor: loss spike or NaN detected, roll me back (sysexits EX_TEMPFAIL)."""
    WORKER_CONFIG = 78
    """Worker -> supervisor: ``gpufleet.init()`` rejected its settings, do not restart (EX_CONFIG)."""

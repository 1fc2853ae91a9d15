"""Process exit codes, documented in docs/supervisor.md.

``gpufleet run`` exits with:
  0   the training command completed (or stopped cleanly after SIGTERM/SIGINT with a final checkpoint)
  1   the run failed for another reason (e.g. a non-restartable error)
  2   bad arguments or configuration
  3   no-progress breaker: K consecutive restarts made no checkpoint progress
  4   restart budget exhausted (--max-restarts)
  5   rollback budget exhausted (--max-rollbacks)
Workers use 75 to tell the supervisor "loss spike / NaN detected, roll me back".
"""

OK = 0
FAILED = 1
USAGE = 2
NO_PROGRESS = 3
MAX_RESTARTS = 4
MAX_ROLLBACKS = 5

WORKER_SPIKE = 75

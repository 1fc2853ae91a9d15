"""``python -m gpufleet.backends.slurm healthcheck [NODE] -- CHECK ...``: the HealthCheckProgram's body."""

import sys

from gpufleet.backends.slurm.actions import main

raise SystemExit(main(sys.argv[1:]))

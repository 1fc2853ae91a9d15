"""`gpufleet run -n 2` of tests/integration/scripts/toy_train.py, as the supervisor tests run it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = str(Path(__file__).resolve().parents[1] / "integration" / "scripts" / "toy_train.py")
GPUFLEET = [sys.executable, "-m", "gpufleet.cli.main"]


def gpufleet_run(
    run_dir: Path, *flags: str, steps: int = 40, timeout: float = 150, extra: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """2 ranks, a checkpoint every 5 steps, a 3 s hang floor; ``flags`` go to `gpufleet run`,
    ``extra`` to the script."""
    cmd = [*GPUFLEET, "run", "-n", "2", "--run-dir", str(run_dir), "--checkpoint-every", "5",
           "--hang-timeout", "3", "--no-progress", *flags, "--", sys.executable, SCRIPT,
           "--steps", str(steps), *extra]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)

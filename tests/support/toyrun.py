"""`gpufleet run -n 2` of tests/integration/scripts/toy_train.py, as the supervisor tests run it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = str(Path(__file__).resolve().parents[1] / "integration" / "scripts" / "toy_train.py")
GPUFLEET = [sys.executable, "-m", "gpufleet.cli.main"]


def gpufleet_run(
    run_dir: Path,
    *flags: str,
    steps: int = 40,
    timeout: float = 150,
    extra: tuple[str, ...] = (),
    nproc: int = 2,
) -> subprocess.CompletedProcess[str]:
    """``nproc`` ranks (2), a checkpoint every 5 steps, a 3 s hang floor; ``flags`` go to `gpufleet run`,
    ``extra`` to the script."""
    cmd = [*GPUFLEET, "run", "-n", str(nproc), "--run-dir", str(run_dir), "--checkpoint-every", "5",
           "--hang-timeout", "3", "--no-progress", *flags, "--", sys.executable, SCRIPT,
           "--steps", str(steps), *extra]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def final_sha(run_dir: Path) -> str:
    """The sha256 of the final weights toy_train.py wrote (the newest final-*.json)."""
    outs = sorted(run_dir.glob("final-*.json"), key=lambda p: p.stat().st_mtime)
    assert outs, f"no final weights in {run_dir}"
    return json.loads(outs[-1].read_text())["sha256"]


def assert_usage_error(run_dir: Path, flags: list[str], needle: str) -> None:
    """`gpufleet run --run-dir RUN_DIR FLAGS` (in this process: it fails before any launch) fails as bad
    input must: exit 2, one line on stderr naming ``needle``, no traceback, nothing written to the ledger."""
    from support.cli import assert_one_line_error, gpufleet

    assert_one_line_error(gpufleet("run", "--run-dir", run_dir, *flags), 2, needle)
    ledger = run_dir / "ledger.jsonl"
    assert not ledger.exists() or ledger.stat().st_size == 0

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
    standby: bool = True,
) -> subprocess.CompletedProcess[str]:
    """``nproc`` ranks (2), a checkpoint every 5 steps, a 3 s hang floor; ``flags`` go to `gpufleet run`,
    ``extra`` to the script. Standby interpreters as users get them (the default): forks of the run's
    warm interpreter, so the ranks share one ``import torch``; ``standby=False``: fresh interpreters."""
    cmd = [*GPUFLEET, "run", "-n", str(nproc), "--run-dir", str(run_dir), "--checkpoint-every", "5",
           "--hang-timeout", "3", "--no-progress", "--standby" if standby else "--no-standby", *flags,
           "--", sys.executable, SCRIPT, "--steps", str(steps), *extra]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def final(run_dir: Path) -> dict:
    """What toy_train.py wrote at the end (the newest final-*.json): ``sha256`` of the final weights,
    the ``steps`` it saw, its parameters' devices."""
    outs = sorted(run_dir.glob("final-*.json"), key=lambda p: p.stat().st_mtime)
    assert outs, f"no final weights in {run_dir}: {sorted(p.name for p in run_dir.iterdir())}"
    return json.loads(outs[-1].read_text())


def final_sha(run_dir: Path) -> str:
    """The sha256 of the final weights toy_train.py wrote."""
    return final(run_dir)["sha256"]


class ToyReferences:
    """Clean runs of toy_train.py (no faults), one per (steps, ranks), made on first use and
    shared by every test of the session that compares its final weights against one."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._finals: dict[tuple[int, int], dict] = {}

    def __call__(self, steps: int = 40, nproc: int = 2) -> dict:
        """The reference's :func:`final` record."""
        key = (steps, nproc)
        if key not in self._finals:
            run_dir = self._root / f"steps{steps}-n{nproc}"
            p = gpufleet_run(run_dir, steps=steps, nproc=nproc, timeout=300)
            assert p.returncode == 0, p.stderr[-2000:]
            self._finals[key] = final(run_dir)
        return self._finals[key]


def assert_usage_error(run_dir: Path, flags: list[str], needle: str) -> None:
    """`gpufleet run --run-dir RUN_DIR FLAGS` (in this process: it fails before any launch) fails as bad
    input must: exit 2, one line on stderr naming ``needle``, no traceback, nothing written to the ledger."""
    from support.cli import assert_one_line_error, gpufleet

    assert_one_line_error(gpufleet("run", "--run-dir", run_dir, *flags), 2, needle)
    ledger = run_dir / "ledger.jsonl"
    assert not ledger.exists() or ledger.stat().st_size == 0

"""Which commands the local backend runs as forks of its warm interpreter: ``python SCRIPT`` and
``python -m MOD`` with this environment's interpreter; anything else, another environment's python
included, runs as a fresh process (the fork would run it with this environment's site-packages)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from gpufleet.backends.base import LaunchSpec
from gpufleet.backends.local import LocalBackend


def _spec(command: list[str]) -> LaunchSpec:
    return LaunchSpec(command=command, nproc_per_node=1)


def test_this_environments_python_is_forked_another_is_not(tmp_path: Path) -> None:
    backend = LocalBackend()
    assert backend.forkable(_spec([sys.executable, "train.py", "--lr", "1"]))
    assert backend.forkable(_spec([sys.executable, "-m", "pkg.train"]))
    other = tmp_path / "bin" / "python"  # the same binary, but another environment's bin directory
    other.parent.mkdir()
    os.symlink(sys.executable, other)
    assert not backend.forkable(_spec([str(other), "train.py"]))
    assert not backend.forkable(_spec(["bash", "train.sh"]))
    assert not backend.forkable(_spec([sys.executable, "-c", "print(1)"]))
    assert not backend.forkable(_spec(["python-that-does-not-exist-here", "train.py"]))

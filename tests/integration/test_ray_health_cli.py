"""`gpufleet health sweep|release --backend ray` on bad input: one line on stderr, exit 2, at once.

No Ray cluster needed: a plan or flag that does not validate is refused before connecting, and an
address nothing listens on is refused before ``ray.init`` (which would retry for minutes). The sweep
on the real cluster is in test_ray_backend.py.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from gpufleet.core.ports import free_port


def gpufleet(*args: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "gpufleet.cli.main", "health", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def dead_address() -> str:
    return f"127.0.0.1:{free_port('127.0.0.1')}"  # free: nothing listens there


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("sweep", "--backend", "ray", "--address", "{dead}"), "cannot reach the Ray cluster at"),
        (("release", "abc123", "--backend", "ray", "--address", "{dead}"), "cannot reach the Ray cluster"),
        (("sweep", "--address", "no-port-here"), "is not HOST:PORT"),
        (("sweep", "--address", "{dead}", "--plan", "nosuch"), "unknown plan 'nosuch'"),
        (("sweep", "--address", "{dead}", "--env", "NO_EQUALS_SIGN"), "is not KEY=VALUE"),
        (("sweep", "--backend", "slurm", "--address", "{dead}"), "'slurm' is not one of 'ray'"),
    ],
    ids=["unreachable", "release-unreachable", "not-host-port", "unknown-plan", "bad-env", "bad-backend"],
)
def test_bad_input_is_one_line_and_exit_2(dead_address, args, says):
    p = gpufleet(*(a.replace("{dead}", dead_address) for a in args))
    assert p.returncode == 2, (p.returncode, p.stdout[-500:], p.stderr[-2000:])
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpufleet: error: ") and says in lines[0], p.stderr
    assert "Traceback" not in p.stderr and p.stdout == ""

"""The srun backend frees the in-memory tier on every node the run used when the run ends (the
supervisor's own exit frees only the batch node's). Slurm is faked at the process boundary: ``srun``
runs the step's command here with ``SLURMD_NODENAME`` set to the node it names, ``scontrol`` answers
the node address; each node's "/dev/shm" is ``shm/<node>`` (``GPUFLEET_MEMORY_TIER_DIR=shm/%n``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from gpufleet.backends import LaunchSpec
from gpufleet.backends.slurm.srun import SrunBackend
from gpufleet.checkpoint.storage.memory import keeper_dir
from gpufleet.core.env import Env

SRUN = """#!{python}
import os, sys
args, node = sys.argv[1:], None
while args[0].startswith("--"):
    opt = args.pop(0)
    if opt.startswith("--nodelist="):
        node = opt.split("=", 1)[1]
if "gpufleet.backends.agent" in args:
    raise SystemExit(0)  # this test's agents start no ranks
with open({log!r}, "a") as f:
    f.write(node + "\\n")
os.environ["SLURMD_NODENAME"] = node
os.execvp(args[0], args)
"""


@pytest.fixture
def slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "srun.log"
    (bin_dir / "srun").write_text(SRUN.format(python=sys.executable, log=str(log)))
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho NodeName=$4 NodeAddr=127.0.0.1\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv(Env.MEMORY_TIER_DIR, str(tmp_path / "shm" / "%n"))
    monkeypatch.delenv("SLURMD_NODENAME", raising=False)
    return log


def keepers(tmp_path: Path, ckpt: Path) -> dict[str, Path]:
    """Each node's keeper of ``ckpt``, holding a file."""
    out = {node: keeper_dir(ckpt, root=tmp_path / "shm" / node) for node in ("n1", "n2", "n3")}
    for d in out.values():
        d.mkdir(parents=True)
        (d / "part").write_bytes(b"x")
    return out


def attempt(b: SrunBackend, run: Path, tier: str) -> None:
    spec = LaunchSpec(command=["true"], nproc_per_node=1, env={Env.RUN_DIR: str(run), Env.MEMORY_TIER: tier})
    b.start(spec).close()


def test_every_used_reachable_node_frees_its_keeper_at_close(tmp_path: Path, slurm: Path) -> None:
    run = tmp_path / "run"
    held = keepers(tmp_path, run / "checkpoints")
    b = SrunBackend(nodes=2, nodelist=["n1", "n2", "n3"])
    attempt(b, run, "16MiB")  # n1 + n2
    b.healthy.remove("n2")  # say a straggler: the next attempt takes the spare
    attempt(b, run, "16MiB")  # n1 + n3
    assert b.used == ["n1", "n2", "n3"]
    b.unreachable.append("n3")  # ... and n3 was then lost: no step can reach it
    b.close()
    assert not held["n1"].exists() and not held["n2"].exists()
    assert held["n3"].exists()
    assert sorted(slurm.read_text().split()) == ["n1", "n2"]  # one release step per node
    b.close()  # once only
    assert sorted(slurm.read_text().split()) == ["n1", "n2"]


def test_no_release_steps_without_the_memory_tier(tmp_path: Path, slurm: Path) -> None:
    run = tmp_path / "run"
    held = keepers(tmp_path, run / "checkpoints")
    b = SrunBackend(nodes=2, nodelist=["n1", "n2", "n3"])
    attempt(b, run, "0")
    b.close()
    assert all(p.exists() for p in held.values())
    assert not slurm.exists()  # no step ran but the agents

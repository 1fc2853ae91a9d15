"""The in-memory checkpoint tier with real processes: a supervised 2-rank gloo run killed with -9
restores from the memory copy and ends bit-identical to an unkilled run; a corrupted memory copy is
rejected by its checksum and the same step comes from disk; bad --memory-tier values are one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpufleet.checkpoint.storage.memory import keeper_dir, release
from gpufleet.core.ledger import read_events
from support.toyrun import final_sha, gpufleet_run

pytestmark = pytest.mark.slow

SCRIPT = str(Path(__file__).parent / "scripts" / "toy_train.py")
GPUFLEET = [sys.executable, "-m", "gpufleet.cli.main"]
BUDGET = 150_000  # toy_train's checkpoints weigh ~106 KB: one fits, each new one evicts the older


def evs(run_dir: Path, name: str) -> list[dict]:
    return [e for e in read_events(run_dir) if e["ev"] == name]


def test_kill_9_restores_from_memory_bit_identical_within_budget(tmp_path: Path, toy_reference) -> None:
    run = tmp_path / "mem"
    p = gpufleet_run(run, "--memory-tier", str(BUDGET), "--inject", "kill:rank=1,step=12,settle=1", steps=30)
    assert p.returncode == 0, p.stderr[-3000:]
    assert [e["cause"] for e in evs(run, "failure")] == ["crash"]
    restores = evs(run, "restore")
    assert len(restores) == 2 and restores[0]["fresh"]
    after = restores[1]
    assert after["source"] == "memory" and after["step"] >= 5
    assert after["path"].startswith(str(keeper_dir(run / "checkpoints")))
    verified = evs(run, "ckpt_verified")
    assert verified[-1]["source"] == "memory" and verified[-1]["step"] == after["step"]
    assert evs(run, "restore_rejected") == []
    kept = evs(run, "ckpt_memory")
    assert kept and all(k["kept"] and k["used_bytes"] <= k["budget_bytes"] == BUDGET for k in kept)
    assert any(k.get("evicted") for k in kept)  # the budget was enforced by eviction, not by luck
    assert final_sha(run) == toy_reference(steps=30)["sha256"]
    assert not keeper_dir(run / "checkpoints").exists()  # gpufleet run frees the memory when it ends


@pytest.fixture
def standalone(tmp_path: Path):
    run = tmp_path / "run"
    env = {
        **os.environ,
        "GPUFLEET_RUN_DIR": str(run),
        "GPUFLEET_CKPT_EVERY": "5",
        "GPUFLEET_MEMORY_TIER": "1MiB",
    }

    def train(steps: int) -> None:
        p = subprocess.run(
            [sys.executable, SCRIPT, "--steps", str(steps)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert p.returncode == 0, p.stderr[-2000:]

    yield run, train
    release(run / "checkpoints")  # a standalone run has no supervisor to free the memory


def test_corrupt_memory_copy_is_rejected_and_disk_restores_the_same_step(standalone) -> None:
    run, train = standalone
    train(10)
    mem = keeper_dir(run / "checkpoints") / "step_00000010"
    assert (mem / "manifest.json").is_file()
    shard = max(mem.glob("*.distcp"), key=lambda f: f.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    train(15)
    rejected = evs(run, "restore_rejected")
    assert len(rejected) == 1 and rejected[0]["path"] == str(mem) and rejected[0]["step"] == 10
    assert "checksum mismatch" in rejected[0]["reason"]
    restore = evs(run, "restore")[-1]
    assert restore["source"] == "local" and restore["step"] == 10
    assert restore["path"] == str(run / "checkpoints" / "step_00000010")


@pytest.mark.parametrize("value", ["lots", "-1GiB", "2 parsecs"])
def test_bad_memory_tier_is_one_line_exit_2(tmp_path: Path, value: str) -> None:
    p = subprocess.run(
        [
            *GPUFLEET,
            "run",
            "--run-dir",
            str(tmp_path / "r"),
            "--memory-tier",
            value,
            "--",
            sys.executable,
            SCRIPT,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2, (p.stdout, p.stderr)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--memory-tier" in lines[0] and "invalid size" in lines[0], p.stderr
    assert not (tmp_path / "r" / "ledger.jsonl").exists()

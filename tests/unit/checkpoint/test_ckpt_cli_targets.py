"""`gpufleet ckpt list/verify` on what users point it at: one checkpoint, the checkpoints directory,
the run directory; and on paths that hold no checkpoint (exit 2, one line on stderr, never a silent 0).

The checkpoints are real ones written by the engine; corruption is a shard truncated to 0 bytes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpufleet.checkpoint import CheckpointConfig, CheckpointEngine
from support.cli import CliResult, gpufleet

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class _Sink:
    def emit(self, ev: str, **fields: object) -> None:
        pass


def _cli(*args: str) -> CliResult:
    return gpufleet("ckpt", *args)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """RUN/checkpoints/step_00000100 (intact) and step_00000200 (its largest shard truncated to 0 bytes)."""
    run = tmp_path_factory.mktemp("run")
    eng = CheckpointEngine(CheckpointConfig(dir=str(run / "checkpoints")), sink=_Sink())
    for step in (100, 200):
        g = torch.Generator().manual_seed(step)
        assert eng.save(step, {"model": {"w": torch.randn(256, 256, generator=g)}, "step": step})
        eng.wait()
    eng.close()
    ck = run / "checkpoints" / "step_00000200"
    shard = max(ck.glob("*.distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(b"")
    return run


def test_verify_a_single_corrupt_checkpoint_is_rejected(run_dir: Path) -> None:
    p = _cli("verify", str(run_dir / "checkpoints" / "step_00000200"))
    assert p.returncode == 1, p.stdout + p.stderr
    assert "REJECTED" in p.stdout and "size mismatch" in p.stdout
    assert "0 of 1 checkpoints verified" in p.stdout


def test_verify_a_single_intact_checkpoint_passes(run_dir: Path) -> None:
    p = _cli("verify", str(run_dir / "checkpoints" / "step_00000100"))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "OK" in p.stdout and "REJECTED" not in p.stdout and "1 of 1 checkpoints verified" in p.stdout


@pytest.mark.parametrize("which", ["checkpoints", "run"])
def test_verify_parent_and_run_dir_report_the_corrupt_one(run_dir: Path, which: str) -> None:
    target = run_dir / "checkpoints" if which == "checkpoints" else run_dir
    p = _cli("verify", str(target))
    assert p.returncode == 1, p.stdout + p.stderr
    assert p.stdout.count("REJECTED") == 1 and p.stdout.count("OK") == 1
    assert "1 of 2 checkpoints verified" in p.stdout
    ok = _cli("verify", str(target), "--step", "100")
    assert ok.returncode == 0 and "1 of 1 checkpoints verified" in ok.stdout


def test_list_accepts_all_three_forms(run_dir: Path) -> None:
    for target in (run_dir, run_dir / "checkpoints", run_dir / "checkpoints" / "step_00000100"):
        p = _cli("list", str(target))
        assert p.returncode == 0, p.stdout + p.stderr
        assert "100" in p.stdout


def _assert_usage_error(p: CliResult, needle: str) -> None:
    assert p.returncode == 2, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], p.stderr


@pytest.mark.parametrize("cmd", ["verify", "list"])
def test_paths_without_checkpoints_exit_2(tmp_path: Path, cmd: str) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    _assert_usage_error(_cli(cmd, str(empty)), "not a checkpoint")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("hello")
    _assert_usage_error(_cli(cmd, str(other)), "not a checkpoint")
    fresh_run = tmp_path / "fresh_run"
    (fresh_run / "checkpoints").mkdir(parents=True)
    _assert_usage_error(_cli(cmd, str(fresh_run)), "no checkpoint directories")
    _assert_usage_error(_cli(cmd, str(tmp_path / "missing")), "no such directory")
    (tmp_path / "file").write_text("x")
    _assert_usage_error(_cli(cmd, str(tmp_path / "file")), "not a directory")


def test_verify_step_not_in_a_single_checkpoint_exits_2(run_dir: Path) -> None:
    p = _cli("verify", str(run_dir / "checkpoints" / "step_00000100"), "--step", "200")
    _assert_usage_error(p, "no checkpoint for step 200")


def test_uncommitted_checkpoint_is_not_listed(tmp_path: Path) -> None:
    torn = tmp_path / "checkpoints" / "step_00000007"
    torn.mkdir(parents=True)
    (torn / "__0_0.distcp").write_bytes(b"partial")
    p = _cli("list", str(tmp_path / "checkpoints"))
    assert p.returncode == 1 and "no committed checkpoints" in p.stdout
    v = _cli("verify", str(torn))
    assert v.returncode == 1 and "REJECTED" in v.stdout and "no manifest" in v.stdout

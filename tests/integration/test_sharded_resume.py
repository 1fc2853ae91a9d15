"""FSDP2 (``fully_shard``) state under the supervisor, and resuming at another world size
(tests/integration/scripts/fsdp_train.py; real processes, gloo on CPU).

- 2 workers with a sharded model and optimizer, one killed mid-run: the final state is bit-identical
  to an unkilled run.
- A run saved by 2 workers resumes with 3 and with 1 on the same run directory: restored at the
  saved step, the resharded state equals the full state that was saved, and the data continues the
  same epoch permutation at the exact next sample (no sample repeated or skipped across the change).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from integration.test_supervisor import GPUFLEET, evs, final

pytestmark = pytest.mark.slow

SCRIPT = str(Path(__file__).parent / "scripts" / "fsdp_train.py")
SAMPLES, BATCH, SEED = 96, 4, 3  # as in the script
K, T = 13, 26  # saved with 2 workers at K (mid-epoch: 12 steps per epoch), resumed to T


def run(run_dir: Path, nproc: int, steps: int, *flags: str, extra: tuple[str, ...] = ()):
    launcher = [
        *GPUFLEET,
        "run",
        "-n",
        str(nproc),
        "--run-dir",
        str(run_dir),
        "--no-progress",
        *flags,
    ]
    cmd = [*launcher, "--", sys.executable, SCRIPT, "--steps", str(steps), *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def full_file(run_dir: Path, prefix: str) -> dict[str, torch.Tensor]:
    outs = sorted(run_dir.glob(f"{prefix}-*.pt"), key=lambda p: p.stat().st_mtime)
    assert outs, f"no {prefix} state in {run_dir}"
    return torch.load(outs[-1])


def trained(run_dir: Path, world: int) -> dict[int, list[int]]:
    """Step -> the samples trained at that step by all ranks, rank order (last record of a step wins)."""
    per_rank: list[dict[int, list[int]]] = []
    for rank in range(world):
        rows: dict[int, list[int]] = {}
        for line in (run_dir / f"seen-rank{rank}.jsonl").read_text().splitlines():
            rec = json.loads(line)
            if rec["world"] == world:
                rows[rec["step"]] = rec["idx"]
        per_rank.append(rows)
    steps = sorted(per_rank[0])
    assert all(sorted(r) == steps for r in per_rank), "ranks trained different steps"
    return {s: [i for r in per_rank for i in r[s]] for s in steps}


def test_fsdp_kill_resumes_bit_identical(tmp_path: Path) -> None:
    ref = tmp_path / "reference"
    run(ref, 2, 20, "--checkpoint-every", "5")
    killed = tmp_path / "killed"
    run(killed, 2, 20, "--checkpoint-every", "5", "--inject", "kill:rank=1,step=12,settle=1")
    assert [f["cause"] for f in evs(killed, "failure")] == ["crash"]
    restores = evs(killed, "restore")
    # The resume is from the newest checkpoint committed by then: step 10's, or step 5's when the
    # kill came before rank 0 committed step 10 (a busy host); bit-identical either way.
    committed = [e["step"] for e in evs(killed, "ckpt_committed") if e["t"] < restores[-1]["t"]]
    assert restores[0]["fresh"] and not restores[-1]["fresh"] and restores[-1]["step"] == max(committed)
    assert restores[-1]["step"] in (5, 10)
    assert "saved_world_size" not in restores[-1]
    assert final(killed)["sha256"] == final(ref)["sha256"]
    assert trained(killed, 2) == trained(ref, 2)


@pytest.fixture(scope="module")
def saved_by_two(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("world") / "two"
    run(d, 2, K, "--checkpoint-every", "1000")  # the only checkpoint: the final one, at K
    assert [e["step"] for e in evs(d, "ckpt_committed")] == [K]
    return d


@pytest.mark.parametrize("nproc", [3, 1])
def test_resume_at_another_world_size(tmp_path: Path, saved_by_two: Path, nproc: int) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(saved_by_two, run_dir)
    saved = full_file(run_dir, "full")
    run(run_dir, nproc, T, "--checkpoint-every", "1000", extra=("--dump-restored",))

    restore = evs(run_dir, "restore")[-1]
    assert restore["step"] == K and not restore["fresh"] and restore["saved_world_size"] == 2
    # the resharded model and optimizer state, gathered again, is exactly what was saved
    restored = full_file(run_dir, "restored")
    assert sorted(restored) == sorted(saved)
    for k, v in saved.items():
        assert torch.equal(restored[k], v), k

    # Data: the steps before K (2 workers, global batch 8) then the steps from K (nproc workers)
    # read each epoch's permutation from its start, in order, without repeat or gap; an epoch ends
    # with less than one global batch left over.
    before, after = trained(run_dir, 2), trained(run_dir, nproc)
    assert sorted(before) == list(range(K)) and sorted(after) == list(range(K, T))
    epochs: dict[int, list[int]] = {}
    for world, rows in ((2, before), (nproc, after)):
        for line in (run_dir / "seen-rank0.jsonl").read_text().splitlines():
            rec = json.loads(line)
            if rec["world"] == world and rec["step"] in rows:
                epochs.setdefault(rec["epoch"], []).extend(rows.pop(rec["step"]))
    assert len(epochs) >= 2
    for epoch, got in sorted(epochs.items()):
        perm = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(SEED + epoch)).tolist()
        assert got == perm[: len(got)], f"epoch {epoch} does not continue its permutation"
        if epoch < max(epochs):
            assert SAMPLES - len(got) < BATCH * max(2, nproc), f"epoch {epoch} skipped samples"


def test_a_per_rank_loader_refuses_another_world_size_with_exit_2(tmp_path: Path) -> None:
    loader_script = str(Path(__file__).parent / "scripts" / "loader_train.py")
    base = [*GPUFLEET, "run", "--run-dir", str(tmp_path), "--no-progress", "--checkpoint-every", "1000"]
    script = ["--", sys.executable, loader_script, "--num-workers", "0", "--steps"]
    first = subprocess.run([*base, "-n", "2", *script, "6"], capture_output=True, text=True, timeout=240)
    assert first.returncode == 0, first.stderr[-3000:]
    p = subprocess.run([*base, "-n", "3", *script, "12"], capture_output=True, text=True, timeout=240)
    assert p.returncode == 2, p.stderr[-3000:]
    assert "saved by 2 workers and this run has 3: state['data'] keeps a position per rank" in p.stderr
    assert not evs(tmp_path, "restart")  # terminal: no restart would fix it


def test_a_distributed_sampler_loader_resumes_at_another_world_size(tmp_path: Path) -> None:
    loader = ("--loader",)
    run(
        tmp_path, 2, K, "--checkpoint-every", "1000", extra=loader
    )  # 12 batches a rank per epoch: K is in epoch 1
    run(tmp_path, 3, T, "--checkpoint-every", "1000", extra=loader)
    restore = evs(tmp_path, "restore")[-1]
    assert restore["step"] == K and restore["saved_world_size"] == 2
    taken: dict[tuple[int, int], list[int]] = {}  # (world, epoch) -> samples
    for rank in range(3):
        for line in (tmp_path / f"seen-rank{rank}.jsonl").read_text().splitlines():
            rec = json.loads(line)
            taken.setdefault((rec["world"], rec["epoch"]), []).extend(rec["idx"])
    assert sorted(taken[2, 0]) == list(range(SAMPLES))
    before, after = taken[2, 1], taken[3, 1]
    assert not set(before) & set(after), "samples of epoch 1 trained again after the change"
    assert set(before) | set(after) == set(range(SAMPLES)), "samples of epoch 1 skipped across the change"
    assert len(before) + len(after) - SAMPLES < 3  # repeats only to even out the 3 ranks' shares
    assert len(set(taken[3, 2])) == len(taken[3, 2])  # the next epoch as the 3-worker sampler draws it

"""The CUDA paths, on a real GPU: pinned staging, a save/restore round trip of CUDA state, supervised
runs on ``run.device`` that resume bit-identically (one rank; several ranks sharing the GPU over gloo,
with an in-process restart and the exact-DDP hook), the launch-time GPU check, and NVML through
`gpufleet health`. CI has no GPU, so these skip there; a GPU machine runs them with
``pytest tests/gpu`` (docs/benchmarks.md lists the last such run).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from gpufleet.checkpoint import CheckpointConfig, CheckpointEngine
from gpufleet.checkpoint.staging import Stager
from gpufleet.core.ledger import read_events

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]

SCRIPT = str(Path(__file__).resolve().parents[1] / "integration" / "scripts" / "toy_train.py")
GPUFLEET = [sys.executable, "-m", "gpufleet.cli.main"]
DETERMINISTIC = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}  # what torch.use_deterministic_algorithms asks


def cuda_state(seed: int, n: int = 1024) -> dict[str, Any]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return {
        "model": {"w": torch.randn(n, n, device="cuda", generator=g), "b": torch.randn(n, device="cuda")},
        "optim": {"exp_avg": torch.randn(n, n, device="cuda", generator=g), "step": torch.tensor(3.0)},
        "step": seed,
    }


def test_staging_copies_cuda_state_into_pinned_buffers_it_reuses() -> None:
    stager = Stager()
    state = cuda_state(0)
    job = stager.stage(state, deferred=lambda k: k.startswith("model"))
    job.done.wait(60)
    assert job.error is None
    staged = job.staged
    for key in ("w", "b"):
        buf = staged["model"][key]
        assert buf.device.type == "cpu" and buf.is_pinned()
        assert torch.equal(buf, state["model"][key].cpu())
    assert staged["optim"]["exp_avg"].is_pinned()
    assert torch.equal(staged["optim"]["exp_avg"], state["optim"]["exp_avg"].cpu())
    ptr = staged["model"]["w"].data_ptr()
    state["model"]["w"].add_(1.0)
    again = stager.stage(state, deferred=lambda k: k.startswith("model"))
    again.done.wait(60)
    assert again.staged["model"]["w"].data_ptr() == ptr  # the same pinned buffer, no new allocation
    assert torch.equal(again.staged["model"]["w"], state["model"]["w"].cpu())


def test_engine_round_trip_of_cuda_state(tmp_path: Path) -> None:
    engine = CheckpointEngine(CheckpointConfig(dir=str(tmp_path / "ckpt")))
    state = cuda_state(1)
    assert engine.save(10, state, deferred=lambda k: k.startswith(("model", "optim")))
    engine.wait(120)
    blank = {
        "model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
        "optim": {"exp_avg": torch.zeros_like(state["optim"]["exp_avg"]), "step": torch.tensor(0.0)},
        "step": -1,
    }
    loaded = engine.load(blank)
    engine.close()
    assert loaded is not None and loaded.step == 10
    for key in ("w", "b"):
        assert blank["model"][key].is_cuda
        assert torch.equal(blank["model"][key], state["model"][key])
    assert torch.equal(blank["optim"]["exp_avg"], state["optim"]["exp_avg"])
    assert blank["step"] == 1  # the state's own "step" entry (cuda_state(1))
    # A fresh engine, as after a restart: no staging buffers yet, the same bytes land on the GPU.
    fresh = CheckpointEngine(CheckpointConfig(dir=str(tmp_path / "ckpt")))
    again = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "optim": blank["optim"]}
    again["optim"]["exp_avg"].zero_()
    assert fresh.load({**again, "step": -1}) is not None
    fresh.close()
    assert torch.equal(again["model"]["w"], state["model"]["w"])
    assert torch.equal(again["optim"]["exp_avg"], state["optim"]["exp_avg"])


def _run(run_dir: Path, nproc: int, *flags: str, steps: int = 60) -> subprocess.CompletedProcess[str]:
    cmd = [*GPUFLEET, "run", "-n", str(nproc), "--run-dir", str(run_dir), "--checkpoint-every", "10",
           "--hang-timeout", "20", "--no-progress", *flags, "--", sys.executable, SCRIPT,
           "--steps", str(steps)]  # fmt: skip
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env={**os.environ, **DETERMINISTIC}
    )


def _final(run_dir: Path) -> dict[str, Any]:
    outs = sorted(run_dir.glob("final-*.json"), key=lambda p: p.stat().st_mtime)
    assert outs, f"no final weights in {run_dir}"
    return json.loads(outs[-1].read_text())


def _paths(run_dir: Path) -> list[str]:
    return [e["path"] for e in read_events(run_dir) if e["ev"] == "restart"]


def test_one_rank_on_the_gpu_resumes_bit_identical_after_kill_9(tmp_path: Path) -> None:
    ref = _run(tmp_path / "ref", 1)
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert _final(tmp_path / "ref")["devices"] == ["cuda:0"]
    hit = _run(tmp_path / "hit", 1, "--inject", "kill:rank=0,step=35,settle=1")
    assert hit.returncode == 0, hit.stderr[-3000:]
    final = _final(tmp_path / "hit")
    assert final["start"] == 30  # restored from the step-30 checkpoint, on the GPU
    assert final["sha256"] == _final(tmp_path / "ref")["sha256"]
    verify = subprocess.run(
        [*GPUFLEET, "ckpt", "verify", str(tmp_path / "hit")], capture_output=True, text=True
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr


@pytest.mark.parametrize("nproc", [2, 3])
def test_ranks_sharing_the_gpu_over_gloo_rejoin_in_process_bit_identical(tmp_path: Path, nproc: int) -> None:
    """Three ranks also exercise the exact-DDP hook on CUDA buckets (train/exactddp.py)."""
    ref = _run(tmp_path / "ref", nproc, "--dist-backend", "gloo")
    assert ref.returncode == 0, ref.stderr[-3000:]
    hit = _run(tmp_path / "hit", nproc, "--dist-backend", "gloo", "--in-process-restart",
               "--inject", "kill:rank=1,step=35,settle=1")  # fmt: skip
    assert hit.returncode == 0, hit.stderr[-3000:]
    assert _final(tmp_path / "hit")["sha256"] == _final(tmp_path / "ref")["sha256"]
    assert _final(tmp_path / "hit")["devices"] == ["cuda:0"]
    assert _paths(tmp_path / "hit") == ["in_process"]


def test_more_ranks_than_gpus_is_refused_before_launch(tmp_path: Path) -> None:
    n = torch.cuda.device_count() + 1
    p = subprocess.run([*GPUFLEET, "run", "-n", str(n), "--run-dir", str(tmp_path / "r"), "--",
                        sys.executable, SCRIPT], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert p.returncode == 2, (p.stdout, p.stderr)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "NCCL needs one per rank" in lines[0], p.stderr
    assert not (tmp_path / "r" / "ledger.jsonl").exists()


def test_health_quick_reads_the_gpus_through_nvml() -> None:
    n = torch.cuda.device_count()
    p = subprocess.run([*GPUFLEET, "health", "check", "--plan", "quick", "--expect-gpus", str(n), "--json",
                        "--no-record"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p.returncode in (0, 1), p.stderr[-3000:]
    report = json.loads(p.stdout)
    assert report["profile"] != "CPU", report["profile"]  # detected from the GPU's name
    results: dict[str, list[dict[str, Any]]] = {}
    for r in report["results"]:
        results.setdefault(r["check"], []).append(r)
    inventory = results["gpu.inventory"][0]
    assert inventory["status"] == "OK" and inventory["value"] == n, inventory
    assert torch.cuda.get_device_name(0) in inventory["detail"], inventory
    states = results["gpu.state"]  # NVML read each GPU's ECC, throttle, clocks, temperature
    assert states and all(r["status"] != "INCOMPLETE" for r in states), states
    matmul = results["compute.matmul"]
    assert all(r["status"] == "OK" for r in matmul), matmul  # above the profile's floor

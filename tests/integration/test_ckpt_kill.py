"""kill -9 at random points during stage, persist, commit and retention, over many seeded trials.

A zygote process imports torch once and forks one saver per trial (fork is cheap; a fresh
interpreter per trial would cost seconds). The saver restores, then checkpoints in a loop; the
zygote SIGKILLs it after a random delay. After every kill the test process restores: it must get
a verified, self-consistent checkpoint at least as new as the last one the saver saw committed,
or None only if nothing was ever committed.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from gpufleet.checkpoint import CheckpointConfig, CheckpointEngine

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

TRIALS = 30
N = 384  # 3 tensors of N*N fp32: ~1.7 MiB per checkpoint, a few ms to tens of ms to persist

ZYGOTE = textwrap.dedent(
    """
    import os, signal, sys, time, warnings
    warnings.simplefilter("ignore")
    import torch
    from gpufleet.checkpoint import CheckpointConfig, CheckpointEngine

    N = int(sys.argv[1])

    def state(v):
        return {"model": {"w": torch.full((N, N), float(v)), "b": torch.full((N,), float(v))},
                "optim": {"state": {0: {"m": torch.full((N, N), float(v))}}}, "step": v}

    def saver(root):
        eng = CheckpointEngine(CheckpointConfig(dir=root, keep_last=2, keep_window_steps=3, io_threads=2))
        sd = state(0)
        r = eng.load(sd)
        step = r.step + 1 if r else 1
        log = os.open(os.path.join(root, "..", "commits.log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        while True:
            sd = state(step)
            eng.save(step, sd, meta={"pos": step}, deferred=lambda k: k.startswith(("model", "optim")))
            eng.wait_staged()
            eng.wait()
            os.write(log, f"{step}\\n".encode())
            step += 1

    for line in sys.stdin:
        root, delay = line.split()
        pid = os.fork()
        if pid == 0:
            try:
                saver(root)
            finally:
                os._exit(3)
        time.sleep(float(delay))
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        print("killed" if os.WIFSIGNALED(status) else f"exited {status}", flush=True)
    """
)


def _phase(root: Path) -> str:
    """Where the kill landed, judged from what it left on disk."""
    names = [p for p in root.iterdir() if p.is_dir()]
    if any(p.name.endswith(".tmp") for p in names):
        return "persist"  # DCP files being written
    if any(not (p / "manifest.json").exists() for p in names):
        return "commit"  # renamed, manifest not yet written (or a retention delete under way)
    return "idle"


def test_kill9_during_save_never_leaves_unloadable_state(tmp_path: Path) -> None:
    rng = random.Random(1234)
    env = dict(os.environ)
    env["PYTHONPATH"] = (
        str(Path(__file__).resolve().parents[2] / "src") + os.pathsep + env.get("PYTHONPATH", "")
    )
    env["OMP_NUM_THREADS"] = "1"
    zygote = subprocess.Popen(
        [sys.executable, "-c", ZYGOTE, str(N)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    root = tmp_path / "ck"
    root.mkdir()
    log = tmp_path / "commits.log"
    newest_seen = 0
    restored_steps = []
    phases = {"persist": 0, "commit": 0, "idle": 0}
    try:
        assert zygote.stdin is not None and zygote.stdout is not None
        for trial in range(TRIALS):
            # Mostly short delays (mid first save), some long ones (many saves and deletions).
            delay = rng.uniform(0.0, 0.15) if trial % 3 else rng.uniform(0.15, 1.0)
            zygote.stdin.write(f"{root} {delay:.4f}\n")
            zygote.stdin.flush()
            assert zygote.stdout.readline().strip() == "killed", (
                f"trial {trial}: saver did not die by SIGKILL"
            )
            phases[_phase(root)] += 1
            committed = [int(x) for x in log.read_text().split()] if log.exists() else []
            if committed:
                newest_seen = max(newest_seen, *committed)
            sd = {
                "model": {"w": torch.zeros(N, N), "b": torch.zeros(N)},
                "optim": {"state": {0: {"m": torch.zeros(N, N)}}},
                "step": -1,
            }
            r = CheckpointEngine(CheckpointConfig(dir=str(root), keep_last=2)).load(sd)
            if r is None:
                assert newest_seen == 0, (
                    f"trial {trial}: nothing loadable although step {newest_seen} committed"
                )
                continue
            assert r.step >= newest_seen, f"trial {trial}: restored {r.step} < committed {newest_seen}"
            v = float(r.step)
            assert sd["step"] == r.step and r.meta == {"pos": r.step}
            for t in (sd["model"]["w"], sd["model"]["b"], sd["optim"]["state"][0]["m"]):
                assert bool((t == v).all()), f"trial {trial}: torn checkpoint at step {r.step}"
            restored_steps.append(r.step)
    finally:
        if zygote.stdin:
            zygote.stdin.close()
        zygote.wait(timeout=30)
    assert newest_seen > 0 and len(restored_steps) >= TRIALS // 2
    # The kills really landed inside saves, not only between them.
    print("kill phases:", phases)
    assert phases["persist"] + phases["commit"] >= 3, phases

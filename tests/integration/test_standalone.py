"""The Run API without a supervisor: rank 0 writes the ledger itself; a spike raises."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from gpufleet.core.ledger import read_events

SCRIPT = str(Path(__file__).parent / "scripts" / "toy_train.py")


def run_standalone(run_dir: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "GPUFLEET_RUN_DIR": str(run_dir), "GPUFLEET_CKPT_EVERY": "10", **env}
    return subprocess.run(
        [sys.executable, SCRIPT, *args], capture_output=True, text=True, env=full_env, timeout=120
    )


def test_standalone_run_resumes_where_it_stopped(tmp_path):
    p = run_standalone(tmp_path, "--steps", "25")
    assert p.returncode == 0, p.stderr
    first = json.loads(next(tmp_path.glob("final-*.json")).read_text())
    assert first["start"] == 0 and first["steps"] == list(range(25))
    assert f"gpufleet: starting fresh in {tmp_path}\n" in p.stderr
    # Asking for more steps continues from the final checkpoint at step 25, exactly.
    p = run_standalone(tmp_path, "--steps", "40")
    assert p.returncode == 0, p.stderr
    ckpt = tmp_path / "checkpoints" / "step_00000025"
    assert f"gpufleet: resuming {tmp_path} from step 25 (checkpoint {ckpt})\n" in p.stderr
    finals = [json.loads(f.read_text()) for f in tmp_path.glob("final-*.json")]
    second = [f for f in finals if f["start"] == 25][0]
    assert second["steps"] == list(range(25, 40))
    evs = read_events(tmp_path)
    assert [e["status"] for e in evs if e["ev"] == "run_end"] == ["completed", "completed"]
    assert len({e["session"] for e in evs}) == 2


def test_standalone_spike_raises_a_clear_error(tmp_path):
    p = run_standalone(
        tmp_path, "--steps", "20", GPUFLEET_FAULTS=json.dumps([{"kind": "nan", "id": 0, "step": 12}])
    )
    assert p.returncode != 0
    assert "SpikeDetected" in p.stderr and "step 12" in p.stderr
    assert any(e["ev"] == "spike" and e["step"] == 12 for e in read_events(tmp_path))


BREAK_SCRIPT = """
import sys, torch, gpufleet
run = gpufleet.init()
model = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
start = run.restore({"model": model, "optim": opt})
seen = []
for step in run.steps(100):
    seen.append(step)
    model(torch.ones(1, 2)).sum().backward()
    opt.step(); opt.zero_grad()
    if step == 19:
        break
run.finish()
print("start", start, "last", seen[-1])
"""


def test_break_out_of_the_loop_checkpoints_after_the_last_finished_step(tmp_path):
    env = {**os.environ, "GPUFLEET_RUN_DIR": str(tmp_path), "GPUFLEET_CKPT_EVERY": "1000"}
    p = subprocess.run(
        [sys.executable, "-c", BREAK_SCRIPT], capture_output=True, text=True, env=env, timeout=120
    )
    assert p.returncode == 0, p.stderr
    assert "start 0 last 19" in p.stdout
    steps = [e["step"] for e in read_events(tmp_path) if e["ev"] == "step"]
    assert steps == list(range(20))
    assert (tmp_path / "checkpoints" / "step_00000020" / "manifest.json").exists()
    p = subprocess.run(
        [sys.executable, "-c", BREAK_SCRIPT], capture_output=True, text=True, env=env, timeout=120
    )
    assert "start 20 last 99" in p.stdout, p.stderr  # resumes after step 19, never repeats it


NO_FINISH_SCRIPT = """
import sys, torch, gpufleet
run = gpufleet.init(checkpoint_every="1")
state = {"w": torch.zeros(16 * 1024 * 1024)}  # 64 MB: its save still persists when the script ends
run.restore(state)
for step in run.steps(2):
    state["w"].add_(1)
    run.log(loss=1.0)
"""


def test_a_script_that_ends_without_finish_lets_its_save_in_flight_commit(tmp_path):
    # The persist thread is a daemon; ended inside torch's C++ code by the interpreter's exit, it
    # would abort the process and leave only a step_*.tmp directory.
    script = tmp_path / "train.py"
    script.write_text(NO_FINISH_SCRIPT)
    run_dir = tmp_path / "run"
    p = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        env={**os.environ, "GPUFLEET_RUN_DIR": str(run_dir)},
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert "terminate called" not in p.stderr
    assert sorted(d.name for d in (run_dir / "checkpoints").iterdir()) == ["step_00000001"]
    assert [e["step"] for e in read_events(run_dir) if e["ev"] == "ckpt_committed"] == [1]

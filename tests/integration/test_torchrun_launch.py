"""torchrun's launch line, unchanged but for its first word: `gpufleet run --nproc-per-node 2
--standalone train.py --arg x` (no `python`, no `--`) runs a plain torchrun script (no gpufleet import,
env:// rendezvous on gloo), and every rank sees torchrun's variables, the launching shell's
environment and --env's (docs/torchrun.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = r"""
import argparse, json, os, sys
import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--arg")
parser.add_argument("--out")
args = parser.parse_args()
dist.init_process_group("gloo")  # env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
t = torch.ones(1)
dist.all_reduce(t)
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
        "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_RUN_ID", "TORCHELASTIC_MAX_RESTARTS", "FROM_SHELL", "FROM_ENV", "FROM_FILE")
seen = {k: os.environ.get(k) for k in keys}
with open(os.path.join(args.out, f"rank-{dist.get_rank()}.json"), "w") as f:
    json.dump({**seen, "arg": args.arg, "sum": t.item(), "python": sys.executable}, f)
dist.destroy_process_group()
"""


def test_a_torchrun_line_runs_with_gpufleet_run_in_place_of_torchrun(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    env_file = tmp_path / "ranks.env"
    env_file.write_text("# the ranks' settings\nFROM_FILE=file\nFROM_ENV=overridden by --env\n")
    gpufleet = Path(sys.executable).parent / "gpufleet"
    argv = [str(gpufleet), "run", "--run-dir", str(tmp_path / "run"), "--no-progress", "--max-restarts", "4"]
    argv += ["--env-file", str(env_file), "--env", "FROM_ENV=env", "--rdzv-id", "job-7"]
    argv += ["--nproc_per_node", "2", "--standalone", "train.py", "--arg", "x", "--out", str(out)]
    env = {**os.environ, "FROM_SHELL": "shell", "OMP_NUM_THREADS": "1"}
    p = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    seen = {int(f.stem.split("-")[1]): json.loads(f.read_text()) for f in out.glob("rank-*.json")}
    assert sorted(seen) == [0, 1]
    for rank, e in seen.items():
        assert (e["RANK"], e["LOCAL_RANK"], e["ROLE_RANK"]) == (str(rank),) * 3
        assert (e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["ROLE_WORLD_SIZE"]) == ("2", "2", "2")
        assert e["GROUP_RANK"] == "0" and e["MASTER_ADDR"] == "127.0.0.1" and int(e["MASTER_PORT"]) > 0
        assert (e["TORCHELASTIC_RESTART_COUNT"], e["TORCHELASTIC_MAX_RESTARTS"]) == ("0", "4")
        assert e["TORCHELASTIC_RUN_ID"] == "job-7"
        assert (e["FROM_SHELL"], e["FROM_ENV"], e["FROM_FILE"]) == ("shell", "env", "file")
        assert e["arg"] == "x" and e["sum"] == 2.0  # its own flags reached it; the collective ran
        assert os.path.samefile(e["python"], sys.executable)  # train.py ran under gpufleet's Python
    assert len({e["MASTER_PORT"] for e in seen.values()}) == 1
    # the values of --env and --env-file never reach the ledger
    ledger = (tmp_path / "run" / "ledger.jsonl").read_text()
    assert "FROM_ENV" not in ledger and "overridden" not in ledger

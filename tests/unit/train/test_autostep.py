"""The zero-code step hook (gpufleet.train.autostep): what it sends on the control channel, that it
chains to a user's sitecustomize, imports no torch at start-up, and stands down for gpufleet.init()."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import gpufleet
from gpufleet.train import autostep

SRC = str(Path(gpufleet.__file__).resolve().parents[1])


@pytest.fixture
def channel(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """A pipe standing in for the supervisor's channel (rank 0, auto telemetry on); the read end."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    monkeypatch.setenv("GPUFLEET_CONTROL_FD", str(w))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("GPUFLEET_AUTO_TELEMETRY", "1")
    autostep.uninstall()
    yield r
    autostep.uninstall()
    os.close(r)
    os.close(w)


def sent(r: int) -> list[dict]:
    out = b""
    while True:
        try:
            chunk = os.read(r, 1 << 16)
        except BlockingIOError:
            break
        if not chunk:
            break
        out += chunk
    return [json.loads(line) for line in out.splitlines()]


def train(steps: int, opt: torch.optim.Optimizer | None = None) -> torch.optim.Optimizer:
    """``steps`` optimizer steps of ``opt`` (default: a new Adam over a new model)."""
    opt = opt or torch.optim.Adam(torch.nn.Linear(4, 1).parameters(), lr=0.01)
    for _ in range(steps):
        opt.zero_grad()
        sum((p * p).sum() for g in opt.param_groups for p in g["params"]).backward()
        opt.step()
    return opt


def test_each_optimizer_step_is_a_heartbeat_and_rank_0_sends_steps(channel: int) -> None:
    autostep.activate()  # torch.optim is loaded already: the hook goes in at once
    assert autostep.active()
    train(3)
    events = sent(channel)
    assert [e["step"] for e in events if e["ev"] == "hb"] == [0, 1, 2]
    steps = [e for e in events if e["ev"] == "step"]
    # The first step's duration is unknown when it ends: it goes out with the second's.
    assert [e["step"] for e in steps] == [0, 1, 2]
    assert steps[0]["t"] < steps[1]["t"] and all(e["dt"] >= 0 for e in steps)


def test_a_resumed_optimizer_numbers_steps_from_its_state_and_a_second_one_is_not_counted(
    channel: int,
) -> None:
    autostep.activate()
    model = torch.nn.Linear(4, 1)
    saved = train(5, torch.optim.Adam(model.parameters())).state_dict()
    autostep.uninstall()  # a new process: the hook starts over
    autostep.activate()
    sent(channel)
    opt = torch.optim.Adam(model.parameters())
    opt.load_state_dict(saved)
    other = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)  # a GAN's second optimizer
    for _ in range(2):
        train(1, opt)
        other.step()
    assert [e["step"] for e in sent(channel) if e["ev"] == "hb"] == [5, 6]


def test_step_heartbeats_carry_the_straggler_timings_with_fwd_from_a_ddp_forward(
    channel: int, tmp_path: Path
) -> None:
    """From the second step on, each heartbeat has ``work`` (the step) and, for a DDP model, ``fwd``
    (the step's start to its first forward's end, so a rank slow before its forward shows there)."""
    import time

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    autostep.activate()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        plain = torch.nn.Linear(4, 1)  # not DDP: no forward hook
        ddp = DDP(torch.nn.Linear(4, 1))
        opt = torch.optim.SGD([*ddp.parameters(), *plain.parameters()], lr=0.01)
        for i in range(3):
            if i == 2:
                time.sleep(0.03)  # a slow data loader, before the forward
            opt.zero_grad()
            (ddp(torch.ones(2, 4)).sum() + plain(torch.ones(2, 4)).sum()).backward()
            opt.step()
    finally:
        dist.destroy_process_group()
    hbs = [e for e in sent(channel) if e["ev"] == "hb"]
    assert [e["step"] for e in hbs] == [0, 1, 2]
    assert "work" not in hbs[0] and "fwd" not in hbs[0]  # the first step's start is unknown
    assert all(0 <= e["fwd"] <= e["work"] for e in hbs[1:])
    assert hbs[2]["fwd"] >= 0.03


def test_torch_save_to_a_path_is_a_checkpoint_and_its_time_the_next_step_stall(
    channel: int, tmp_path: Path
) -> None:
    autostep.activate()
    opt = train(1)
    torch.save({"x": torch.zeros(100)}, tmp_path / "snap.pt")
    torch.save({"x": 1}, __import__("io").BytesIO())  # a buffer: not a checkpoint
    train(1, opt)
    events = sent(channel)
    (ckpt,) = [e for e in events if e["ev"] == "ckpt_committed"]
    assert ckpt["step"] == 0 and ckpt["path"] == str(tmp_path / "snap.pt")
    assert ckpt["bytes"] == (tmp_path / "snap.pt").stat().st_size and ckpt["persist_s"] >= 0
    step1 = next(e for e in events if e["ev"] == "step" and e["step"] == 1)
    assert 0 < step1["stall"] <= step1["dt"]
    autostep.uninstall()
    assert not hasattr(torch.save, "__wrapped__")  # the original is back


def test_gpufleet_step_reports_without_an_optimizer_and_then_stands_the_hook_down(channel: int) -> None:
    autostep.activate()
    gpufleet.step()
    gpufleet.step(7)
    train(1)  # the script counts its own steps now: the optimizer hook is out
    assert [e["step"] for e in sent(channel) if e["ev"] == "hb"] == [0, 7]
    assert not autostep.active()


def test_off_without_the_flag_and_without_a_channel(channel: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUFLEET_AUTO_TELEMETRY", "0")
    autostep.activate()
    assert not autostep.active()
    monkeypatch.setenv("GPUFLEET_AUTO_TELEMETRY", "1")
    monkeypatch.delenv("GPUFLEET_CONTROL_FD")  # not under gpufleet run: the first step turns it off
    autostep.activate()
    train(2)
    assert not autostep.active() and sent(channel) == []


def test_no_double_count_with_gpufleet_init(channel: int, tmp_path: Path) -> None:
    autostep.activate()
    run = gpufleet.init(run_dir=str(tmp_path / "run"), checkpoint_every="1000")
    assert not autostep.active()  # the Run reports the steps
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.Adam(model.parameters())
    run.restore({"model": model, "optim": opt})
    for _ in run.steps(3):
        train(1, opt)
    run.finish()
    events = sent(channel)
    assert [e["step"] for e in events if e["ev"] == "step"] == [0, 1, 2]
    # Every step heartbeat is the Run's own (it names the total); none from the hook.
    assert [e.get("total") for e in events if e["ev"] == "hb" and e.get("phase") is None] == [3, 3, 3]


def _fresh(code: str, tmp_path: Path, *extra_path: str, flag: str = "1") -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEET_")}
    env["PYTHONPATH"] = os.pathsep.join([autostep.AUTOSTART_DIR, SRC, *extra_path])
    env["GPUFLEET_AUTO_TELEMETRY"] = flag
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    return p.stdout.strip()


def test_start_up_imports_no_torch_and_chains_to_the_users_sitecustomize(tmp_path: Path) -> None:
    user = tmp_path / "user"
    user.mkdir()
    (user / "sitecustomize.py").write_text("import builtins\nbuiltins.USER_SITE_RAN = True\n")
    code = (
        "import sys, builtins\n"
        "print('torch' in sys.modules, getattr(builtins, 'USER_SITE_RAN', False),"
        " sys.modules['sitecustomize'].__file__,"
        " any(type(f).__name__ == '_Watcher' for f in sys.meta_path))"
    )
    torch_loaded, user_ran, site, watching = _fresh(code, tmp_path, str(user)).split()
    assert (torch_loaded, user_ran, watching) == ("False", "True", "True")
    assert site == str(user / "sitecustomize.py")
    # Once the script imports torch the hook is in, and torch.optim.optimizer keeps its own loader.
    code = (
        "import sys, torch\nfrom gpufleet.train import autostep\n"
        "print(autostep.active(), type(sys.modules['torch.optim.optimizer'].__loader__).__name__)"
    )
    assert _fresh(code, tmp_path).split() == ["True", "SourceFileLoader"]
    assert _fresh(code, tmp_path, flag="0").split() == ["False", "SourceFileLoader"]

"""Shared by the P3/P4 benchmark training scripts: the model, the data, crash injection, timestamps.

Everything here is plain PyTorch (no gpufleet), so the gpufleet and the torchrun variants of a
benchmark run the same model, the same data and the same crash logic. Timestamps are wall-clock
``time.time()`` (one host, so comparable between processes) written as JSON lines to files in
``BENCH_OUT`` (a directory the benchmark driver chooses).
"""

from __future__ import annotations

import json
import os
import signal
import time

import torch
import torch.nn as nn


def out_dir() -> str:
    d = os.environ.get("BENCH_OUT", ".")
    os.makedirs(d, exist_ok=True)
    return d


def append(name: str, record: dict) -> None:
    """Append one JSON line to BENCH_OUT/name (one write: lines from different processes don't mix)."""
    line = (json.dumps(record) + "\n").encode()
    fd = os.open(os.path.join(out_dir(), name), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def build_model(width: int, depth: int = 3, dim: int = 512) -> nn.Module:
    """An MLP of ``depth`` hidden layers; with AdamW its state is ~3 x 4 bytes x params."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(dim, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, dim))
    return nn.Sequential(*layers)


def state_bytes(model: nn.Module) -> int:
    """Parameters + AdamW's two moments, in bytes (what a checkpoint holds)."""
    return 3 * sum(p.numel() * p.element_size() for p in model.parameters())


def batch(step: int, rank: int, batch_size: int, dim: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randn(batch_size, dim, generator=g)
    return x, torch.tanh(x.flip(1))


def crash_now(tag: str, **fields: object) -> None:
    """Record the crash time, then SIGKILL this process (no cleanup, like a real crash)."""
    append("crash.jsonl", {"t": time.time(), "pid": os.getpid(), "tag": tag, **fields})
    os.kill(os.getpid(), signal.SIGKILL)


def crash_once_at(step: int, rank: int, kill_rank: int, kill_step: int | None) -> None:
    """SIGKILL ``kill_rank`` at ``kill_step``, on the first attempt only (marker: crash.jsonl exists)."""
    if kill_step is None or rank != kill_rank or step != kill_step:
        return
    if os.path.exists(os.path.join(out_dir(), "crash.jsonl")):
        return
    crash_now("kill", step=step, rank=rank)

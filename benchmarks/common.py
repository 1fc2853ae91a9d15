"""Shared helpers of the checkpoint benchmarks: a state of a given size, cache dropping, tables."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

RESULTS = Path(__file__).resolve().parent / "results"


def make_state(size_gb: float, hidden: int = 4096) -> dict[str, Any]:
    """An MLP's parameters plus Adam state (exp_avg, exp_avg_sq, step) totalling ~size_gb."""
    per_layer = 3 * (hidden * hidden + hidden) * 4  # params + 2 Adam moments, fp32
    layers = max(1, round(size_gb * 1e9 / per_layer))
    model, state = {}, {}
    g = torch.Generator().manual_seed(0)
    for i in range(layers):
        w, b = f"layers.{i}.weight", f"layers.{i}.bias"
        model[w] = torch.empty(hidden, hidden).uniform_(-0.01, 0.01, generator=g)
        model[b] = torch.zeros(hidden)
        for j, k in enumerate((w, b)):
            state[2 * i + j] = {
                "step": torch.tensor(10.0),
                "exp_avg": torch.full_like(model[k], 1e-3),
                "exp_avg_sq": torch.full_like(model[k], 1e-6),
            }
    groups = [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "params": list(range(2 * layers))}]
    return {
        "model": model,
        "optim": {"state": state, "param_groups": groups},
        "step": 10,
        "rng": torch.get_rng_state(),
    }


def state_bytes(sd: Any) -> int:
    if isinstance(sd, torch.Tensor):
        return sd.nbytes
    if isinstance(sd, dict):
        return sum(state_bytes(v) for v in sd.values())
    if isinstance(sd, list | tuple):
        return sum(state_bytes(v) for v in sd)
    return 0


def blank_like(sd: Any) -> Any:
    if isinstance(sd, torch.Tensor):
        return torch.empty_like(sd)
    if isinstance(sd, dict):
        return {k: blank_like(v) for k, v in sd.items()}
    return sd


def drop_caches(paths: list[Path]) -> str:
    """Evict file pages so the next read hits the disk. Returns how it was done."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return "drop_caches"
    except OSError:
        for root in paths:
            for p in [root] if root.is_file() else [q for q in root.rglob("*") if q.is_file()]:
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
        return "fadvise_dontneed"


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def print_table(title: str, header: list[str], rows: list[list[Any]]) -> None:
    cells = [header] + [[f"{c:.4g}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(f"\n{title}")
    for n, r in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
        if n == 0:
            print("  ".join("-" * w for w in widths))


def write_json(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        "time": time.time(),
        **payload,
    }
    out = RESULTS / name
    out.write_text(json.dumps(payload, indent=1) + "\n")
    return out

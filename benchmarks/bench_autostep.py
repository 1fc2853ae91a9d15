"""The zero-code step hook's cost per optimizer step (gpufleet.train.autostep), hook on vs off.

One process as rank 0 (the rank that sends most: a heartbeat and a ``step`` event per step) steps a
small model's Adam in blocks of ``--steps`` steps, alternating hook off and hook on ``--repeats``
times, so machine noise hits both alike. The events go to a pipe that a thread drains, as the
supervisor reads it. The step itself is kept tiny so the hook's share of it shows; the figure that
counts is the added time per step against a 50 ms training step (the budget: 1%).

``python benchmarks/bench_autostep.py [--repeats 7] [--steps 2000]``; JSON to
benchmarks/results/autostep.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from typing import Any

import torch

from common import median, print_table, write_json
from gpufleet.train import autostep

STEP_S = 0.050  # the training step the budget is stated against


def block(opt: torch.optim.Optimizer, params: list[torch.Tensor], steps: int) -> float:
    """Seconds per step over ``steps`` optimizer steps."""
    for p in params:
        p.grad = torch.ones_like(p)
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.step()
    return (time.perf_counter() - t0) / steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, default=2000)
    args = ap.parse_args()

    r, w = os.pipe()
    drain = threading.Thread(
        target=lambda: [None for _ in iter(lambda: os.read(r, 1 << 16), b"")], daemon=True
    )
    drain.start()
    os.environ.update({"GPUFLEET_CONTROL_FD": str(w), "RANK": "0", "GPUFLEET_AUTO_TELEMETRY": "1"})
    model = torch.nn.Linear(64, 64)
    params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=1e-4)
    block(opt, params, 200)  # warm-up: Adam's state, the allocator

    off: list[float] = []
    on: list[float] = []
    call: list[float] = []  # the hook alone, called as torch calls it: less noisy than on - off
    for _ in range(args.repeats):
        autostep.uninstall()
        off.append(block(opt, params, args.steps))
        autostep.activate()
        assert autostep.active()
        on.append(block(opt, params, args.steps))
        hook = sys.modules["torch.optim.optimizer"]._global_optimizer_post_hooks  # what torch calls
        fns = list(hook.values())
        t0 = time.perf_counter()
        for _ in range(args.steps):
            for fn in fns:
                fn(opt, (), {})
        call.append((time.perf_counter() - t0) / args.steps)
    autostep.uninstall()

    off_s, on_s, call_s = median(off), median(on), median(call)
    added = on_s - off_s
    load = os.getloadavg()
    result: dict[str, Any] = {
        "repeats": args.repeats,
        "steps": args.steps,
        "off_step_s": off_s,
        "on_step_s": on_s,
        "ratio": on_s / off_s,
        "added_s": added,
        "share_of_50ms": added / STEP_S,
        "hook_call_s": call_s,
        "hook_call_share_of_50ms": call_s / STEP_S,
        "loadavg": list(load),
        "off_all": off,
        "on_all": on,
        "call_all": call,
    }
    print_table(
        f"step hook, median of {args.repeats} x {args.steps} steps (load average {load[0]:.2f})",
        ["hook", "s/step", "ratio", "added s/step", "% of a 50 ms step"],
        [
            ["off", off_s, 1.0, 0.0, 0.0],
            ["on", on_s, on_s / off_s, added, 100 * added / STEP_S],
            ["hook call alone", call_s, float("nan"), call_s, 100 * call_s / STEP_S],
        ],
    )
    print(f"\nwrote {write_json('autostep.json', result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

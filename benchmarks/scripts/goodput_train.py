"""P4 training script: the MLP of benchcommon under the Run API, with failures at a set MTBF.

Failures: BENCH_KILL_SCHEDULE is a comma-separated list of seconds, one per attempt
(GPUFLEET_ATTEMPT picks the entry). In attempt ``a`` rank ``--kill-rank`` SIGKILLs itself at the first
step boundary once ``schedule[a]`` seconds have passed since that attempt's first completed step
(after writing the time to BENCH_OUT/crash.jsonl). The benchmark draws the schedule from an
exponential distribution with mean M, seeded, so failures form a Poisson process in up-time.
"""

import argparse
import os
import time

import benchcommon as bc
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gpufleet


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--kill-rank", type=int, default=1)
    args = ap.parse_args()

    run = gpufleet.init()
    attempt = int(os.environ.get("GPUFLEET_ATTEMPT", "0"))
    schedule = [float(x) for x in os.environ.get("BENCH_KILL_SCHEDULE", "").split(",") if x]
    kill_after = schedule[attempt] if run.rank == args.kill_rank and attempt < len(schedule) else None

    model = bc.build_model(args.width)
    if run.world_size > 1:
        model = DDP(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    run.restore({"model": model, "optim": optim})
    clock = None  # this attempt's up-time clock starts when its first step completes
    for step in run.steps(args.steps):
        if kill_after is not None and clock is not None and time.time() - clock >= kill_after:
            bc.crash_now("kill", step=step, rank=run.rank, attempt=attempt, after=kill_after)
        x, y = bc.batch(step, run.rank, args.batch)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        run.log(loss=loss)
        optim.step()
        optim.zero_grad()
        if clock is None:
            clock = time.time()
    run.finish()


if __name__ == "__main__":
    main()

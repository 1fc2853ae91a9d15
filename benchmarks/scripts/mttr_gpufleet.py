"""P3 training script, gpufleet flavour: the MLP of benchcommon under the Run API.

Run it with ``gpufleet run -n 2 --checkpoint-every N -- python mttr_gpufleet.py --kill-step K``.
Rank 1 SIGKILLs itself at step K on the first attempt (after writing the crash time); rank 0
writes each completed step's time to BENCH_OUT/steps.jsonl, with this process's start-up times
on its first step. Same logic, model and data as ``mttr_torchrun.py``.
"""

import time

T_PROC = time.time()  # before any import: a fresh interpreter pays for `import torch` after this

import argparse  # noqa: E402
import os  # noqa: E402

import benchcommon as bc  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import gpufleet  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--width", type=int, default=1536)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--kill-step", type=int, default=None)
    ap.add_argument("--kill-rank", type=int, default=1)
    args = ap.parse_args()
    t_imported = time.time()

    run = gpufleet.init()
    t_init = time.time()
    model = bc.build_model(args.width)
    if run.world_size > 1:
        model = DDP(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    t_built = time.time()
    start = run.restore({"model": model, "optim": optim})
    t_loaded = time.time()
    first = True
    for step in run.steps(args.steps):
        bc.crash_once_at(step, run.rank, args.kill_rank, args.kill_step)
        x, y = bc.batch(step, run.rank, args.batch)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        run.log(loss=loss)
        optim.step()
        optim.zero_grad()
        if run.rank == 0:
            rec = {"t": time.time(), "pid": os.getpid(), "step": step}
            if first:
                rec.update(
                    start=start,
                    proc=T_PROC,
                    imported=t_imported,
                    init=t_init,
                    built=t_built,
                    loaded=t_loaded,
                    state_bytes=bc.state_bytes(getattr(model, "module", model)),
                )
                first = False
            bc.append("steps.jsonl", rec)
    run.finish()


if __name__ == "__main__":
    main()

"""A plain PyTorch training loop, adapted to gpufleet. The lines marked ``# gpufleet`` are the whole change.

Run it on its own (one process, checkpoints under runs/default):

    python examples/minimal_train.py

or supervised, with 2 ranks, a checkpoint every 20 steps and a crash drill:

    gpufleet run -n 2 --run-dir runs/minimal --checkpoint-every 20 --inject kill:rank=1,step=60 \\
        -- python examples/minimal_train.py

and see where the time went with ``gpufleet report runs/minimal``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gpufleet  # gpufleet


def main() -> None:
    torch.manual_seed(0)
    run = gpufleet.init()  # gpufleet: joins the supervised run, sets up torch.distributed (gloo on CPU)

    # A toy regression problem: y = x @ w_true + noise.
    g = torch.Generator().manual_seed(0)
    x_all = torch.randn(4096, 16, generator=g)
    y_all = x_all @ torch.randn(16, 1, generator=g) + 0.1 * torch.randn(4096, 1, generator=g)

    net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1))
    model = DDP(net) if run.world_size > 1 else net
    optim = torch.optim.AdamW(net.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=100, gamma=0.5)
    sampler = gpufleet.StepSampler(
        len(x_all), 64, seed=0, rank=run.rank, world_size=run.world_size
    )  # gpufleet

    state = {"model": net, "optim": optim, "sched": sched, "rng": gpufleet.RNGState()}  # gpufleet
    start = run.restore(state)  # gpufleet: newest verified checkpoint, or 0 when fresh

    for step in run.steps(200, steps_per_epoch=sampler.steps_per_epoch):  # gpufleet (was: range(200))
        idx = sampler.indices(step)  # gpufleet: exact resume, no repeated or skipped samples
        loss = nn.functional.mse_loss(model(x_all[idx]), y_all[idx])
        loss.backward()
        run.log(loss=loss.detach())  # gpufleet: NaN/spike guard, agreed across ranks
        optim.step()
        sched.step()
        optim.zero_grad()
        if run.is_main and step % 50 == 49:
            print(
                f"step {step + 1} epoch {run.epoch} loss {loss.item():.4f} (resumed at {start})", flush=True
            )

    run.finish()  # gpufleet: final checkpoint, clean exit


if __name__ == "__main__":
    main()

"""A plain torchrun-style training script: no gpufleet import, nothing gpufleet-specific.

env:// rendezvous, DDP on gloo, a DistributedSampler, Adam, and its own ``torch.save`` snapshot
every ``--snapshot-every`` steps (rank 0), from which it resumes when one exists. A fresh start (no
snapshot) sleeps ``--fresh-sleep`` seconds per step, so a test can kill it mid-run; a resumed one
runs at full speed. ``--slow-rank R --slow-delay S``: rank R sleeps S seconds before each forward, in
every run, as a rank with a slow data pipeline would. Rank 0 writes ``DIR/done.json`` (the step it
resumed at, the steps it ran).
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--snapshot-every", type=int, default=10)
    ap.add_argument("--fresh-sleep", type=float, default=0.0)
    ap.add_argument("--slow-rank", type=int, default=-1)
    ap.add_argument("--slow-delay", type=float, default=0.0)
    args = ap.parse_args()

    dist.init_process_group("gloo")  # env:// (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE)
    rank = dist.get_rank()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(512, 16, generator=g), torch.randn(512, 1, generator=g))
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    snapshot = os.path.join(args.dir, "snapshot.pt")
    start = 0
    if os.path.exists(snapshot):
        state = torch.load(snapshot, weights_only=False)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start = state["step"]
    fresh = start == 0

    step, epoch, ran = start, start // len(loader), 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            if epoch * len(loader) + i < step:
                continue  # batches the snapshot already covered
            if rank == args.slow_rank:
                time.sleep(args.slow_delay)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step, ran = step + 1, ran + 1
            if rank == 0 and step % args.snapshot_every == 0:
                state = {"model": model.module.state_dict(), "optim": opt.state_dict(), "step": step}
                torch.save(state, snapshot + ".tmp")
                os.replace(snapshot + ".tmp", snapshot)
            if fresh and args.fresh_sleep:
                time.sleep(args.fresh_sleep)
            if step >= args.steps:
                break
        epoch += 1
    dist.barrier()
    if rank == 0:
        with open(os.path.join(args.dir, "done.json"), "w") as f:
            json.dump({"resumed_at": start, "ran": ran}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

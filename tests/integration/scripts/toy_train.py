"""A small, deterministic training job for the supervisor tests (plain PyTorch + the gpufleet Run API).

Model, data and DDP live on ``run.device``, as a GPU user writes it, so tests/gpu runs it on a GPU
(where ``torch.use_deterministic_algorithms`` needs ``CUBLAS_WORKSPACE_CONFIG=:4096:8``). Writes
RUN_DIR/final-PID.json with the sha256 of the final weights (rank 0), the steps it saw and the
devices of its parameters.
"""

import argparse
import hashlib
import json
import os
import sys

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gpufleet


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--width", type=int, default=32)
    # A collective of the script's own in the loop (the run API cannot absorb its error in place)
    ap.add_argument("--user-allreduce", action="store_true")
    # DDP with the script's own communication hook (torch's plain all-reduce hook)
    ap.add_argument("--own-comm-hook", action="store_true")
    # Rank 1's hot spares fail while they build (before gpufleet.init): rank 1 has no spare to promote
    ap.add_argument("--rank1-spares-fail", action="store_true")
    args = ap.parse_args()
    if args.rank1_spares_fail and os.environ.get("GPUFLEET_SPARE") == "1":
        sys.exit(1)
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)

    run = gpufleet.init()
    dev = run.device
    data = torch.randn(512, 16, generator=torch.Generator().manual_seed(1)).to(dev)
    target = data @ torch.randn(16, 1, generator=torch.Generator().manual_seed(2)).to(dev)
    model = nn.Sequential(nn.Linear(16, args.width), nn.Dropout(0.1), nn.ReLU(), nn.Linear(args.width, 1)).to(
        dev
    )
    if run.world_size > 1:
        model = DDP(model, device_ids=[dev] if dev.type == "cuda" else None)
        if args.own_comm_hook:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            model.register_comm_hook(None, default_hooks.allreduce_hook)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=20, gamma=0.5)
    sampler = gpufleet.StepSampler(len(data), 16, seed=3, rank=run.rank, world_size=run.world_size)
    state = {"model": model, "optim": optim, "sched": sched, "rng": gpufleet.RNGState()}
    start = run.restore(state)
    seen = []
    for step in run.steps(args.steps, steps_per_epoch=sampler.steps_per_epoch):
        idx = sampler.indices(step)
        seen.append(step)
        loss = nn.functional.mse_loss(model(data[idx]), target[idx])
        loss.backward()
        if args.user_allreduce:
            torch.distributed.all_reduce(loss.detach().clone())
        run.log(loss=loss)
        optim.step()
        sched.step()
        optim.zero_grad()
        if args.sleep:
            import time

            time.sleep(args.sleep)
    run.finish()
    if run.rank == 0:
        inner = getattr(model, "module", model)
        h = hashlib.sha256()
        for k, v in sorted(inner.state_dict().items()):
            h.update(k.encode())
            h.update(v.detach().cpu().numpy().tobytes())
        devices = sorted({str(p.device) for p in inner.parameters()})
        out = {"sha256": h.hexdigest(), "start": start, "steps": seen, "pid": os.getpid(), "devices": devices}
        with open(os.path.join(run.run_dir, f"final-{os.getpid()}.json"), "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()

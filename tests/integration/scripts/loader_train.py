"""A training script as users write it: a shuffled DataLoader with worker processes, no thread pinning.

Adapted to gpufleet with the run API and ``gpufleet.resumable(loader)``. Writes
RUN_DIR/final-<pid>.json with the sha256 of the final weights (rank 0), and every rank appends the
sample indices of each step it trained to RUN_DIR/seen-rank<R>.jsonl (to check no repeat, no skip).
"""

import argparse
import hashlib
import json
import os
import time

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import gpufleet


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--num-workers", type=int, default=2)
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--samples", type=int, default=200)
    args = ap.parse_args()
    torch.manual_seed(0)

    run = gpufleet.init()
    x = torch.randn(args.samples, 16, generator=torch.Generator().manual_seed(1))
    y = x @ torch.randn(16, 1, generator=torch.Generator().manual_seed(2))
    data = TensorDataset(torch.arange(len(x)), x, y)
    # shuffle=True without a generator: the order comes from torch's global RNG, the hardest case
    loader = DataLoader(data, batch_size=8, shuffle=True, num_workers=args.num_workers)
    model = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.1), nn.ReLU(), nn.Linear(32, 1))
    if run.world_size > 1:
        model = DDP(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = gpufleet.resumable(loader)
    state = {"model": model, "optim": optim, "rng": gpufleet.RNGState(), "data": batches}
    start = run.restore(state)
    seen = open(os.path.join(run.run_dir, f"seen-rank{run.rank}.jsonl"), "a")
    for step in run.steps(args.steps, steps_per_epoch=batches.steps_per_epoch):
        idx, xb, yb = next(batches)
        loss = nn.functional.mse_loss(model(xb), yb)
        loss.backward()
        run.log(loss=loss)
        optim.step()
        optim.zero_grad()
        seen.write(json.dumps({"step": step, "epoch": batches.epoch, "idx": idx.tolist()}) + "\n")
        seen.flush()
        if args.sleep:
            time.sleep(args.sleep)
    run.finish()
    if run.rank == 0:
        inner = getattr(model, "module", model)
        h = hashlib.sha256()
        for k, v in sorted(inner.state_dict().items()):
            h.update(k.encode())
            h.update(v.detach().numpy().tobytes())
        out = {"sha256": h.hexdigest(), "start": start, "pid": os.getpid()}
        with open(os.path.join(run.run_dir, f"final-{os.getpid()}.json"), "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()

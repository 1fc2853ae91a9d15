"""A small model sharded with FSDP2 (``fully_shard``) when there are several workers, plain on one.

Adapted to gpufleet with the run API; data through ``gpufleet.StepSampler``, or with --loader a
``DataLoader`` with a ``DistributedSampler`` wrapped in ``gpufleet.resumable``. Every rank appends the
sample indices it trained at each step to RUN_DIR/seen-rank<R>.jsonl. Rank 0 writes
RUN_DIR/final-<pid>.json (sha256 of the full model and optimizer state, gathered from the shards) and
RUN_DIR/full-<pid>.pt (that full state); with --dump-restored also RUN_DIR/restored-<pid>.pt, the
full state right after the restore (to compare a resharded load with what was saved).
"""

import argparse
import hashlib
import json
import os
import time

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import gpufleet

SAMPLES, BATCH = 96, 4


def full_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The unsharded model and optimizer state (a collective under FSDP), flattened to tensors."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    out = {f"model.{k}": v for k, v in get_model_state_dict(model, options=opts).items()}
    osd = get_optimizer_state_dict(model, optim, options=opts)
    for name, st in osd.get("state", {}).items():  # empty off rank 0 (cpu_offload)
        for k, v in st.items():
            out[f"optim.{name}.{k}"] = torch.as_tensor(v)
    return out


def digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k, v in sorted(state.items()):
        h.update(k.encode())
        h.update(v.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--dump-restored", action="store_true")
    ap.add_argument("--loader", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)

    run = gpufleet.init()
    x = torch.randn(SAMPLES, 16, generator=torch.Generator().manual_seed(1))
    y = x @ torch.randn(16, 1, generator=torch.Generator().manual_seed(2))
    model = nn.Sequential(nn.Linear(16, 33), nn.Dropout(0.1), nn.ReLU(), nn.Linear(33, 1))
    if run.world_size > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (run.world_size,))
        for layer in (model[0], model[3]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sampler = gpufleet.StepSampler(SAMPLES, BATCH, seed=3, rank=run.rank, world_size=run.world_size)
    data = sampler
    if args.loader:
        ds = TensorDataset(torch.arange(SAMPLES))
        dsampler = DistributedSampler(ds, num_replicas=run.world_size, rank=run.rank, shuffle=True, seed=3)
        data = batches = gpufleet.resumable(DataLoader(ds, batch_size=BATCH, sampler=dsampler))
    state = {"model": model, "optim": optim, "data": data, "rng": gpufleet.RNGState()}
    start = run.restore(state)
    if args.dump_restored:
        restored = full_state(model, optim)
        if run.rank == 0:
            torch.save(restored, os.path.join(run.run_dir, f"restored-{os.getpid()}.pt"))
    seen = open(os.path.join(run.run_dir, f"seen-rank{run.rank}.jsonl"), "a")
    for step in run.steps(args.steps, steps_per_epoch=None if args.loader else sampler.steps_per_epoch):
        if args.loader:
            idx = next(batches)[0].tolist()
            epoch = batches.epoch
        else:
            idx = sampler.indices(step)
            epoch = sampler.epoch_of(step)
        loss = nn.functional.mse_loss(model(x[idx]), y[idx])
        loss.backward()
        run.log(loss=loss)
        optim.step()
        optim.zero_grad()
        rec = {"step": step, "epoch": epoch, "world": run.world_size, "idx": idx}
        seen.write(json.dumps(rec) + "\n")
        seen.flush()
        if args.sleep:
            time.sleep(args.sleep)
    final = full_state(model, optim)  # a collective: before finish() closes the process group
    run.finish()
    if run.rank == 0:
        torch.save(final, os.path.join(run.run_dir, f"full-{os.getpid()}.pt"))
        out = {"sha256": digest(final), "start": start, "pid": os.getpid()}
        with open(os.path.join(run.run_dir, f"final-{os.getpid()}.json"), "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()

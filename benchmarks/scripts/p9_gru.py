"""P9's training script: the GRU language model of gru_lm.py, as a user writes it, with no thread pinning.

Two forms of the same training (model, data, optimizer, schedule, batch):

* ``--launcher gpufleet``: adapted to the run API (``gpufleet.init``, ``run.restore``, ``run.steps``,
  ``run.log``), checkpoints by gpufleet every ``--ckpt-every`` steps (0: none).
* ``--launcher torchrun``: plain PyTorch under torchrun: DDP on gloo, a loop over steps, and every
  ``--ckpt-every`` steps a synchronous ``torch.distributed.checkpoint.save`` of the model and optimizer
  (through ``get_state_dict``), as the DCP tutorial does.

Rank 0 writes ``$BENCH_OUT/steps.json``: the wall time at the end of every step (``time.perf_counter``
of rank 0, after the optimizer step), its process CPU time there (all its threads), the thread count
it ran with and its affinity.

``--micro N`` (gpufleet only): instead of training, the run API's per-step cost on its own, on the
same process group: N bare ``dist.all_reduce`` calls of the 4-value control vector, N empty
``run.steps`` iterations (the control all-reduce runs at the end of each), and N with ``run.log(loss=)``
(the guard too); written to ``$BENCH_OUT/micro.json`` in microseconds per step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from importlib import resources
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from gru_lm import GRULM, Windows  # the same model and data as the soak
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler


def build(args: argparse.Namespace, rank: int, world: int):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    text = (resources.files("gpufleet") / "data" / "shakespeare.txt").read_text()[: args.chars]
    vocab = sorted(set(text))
    ids = torch.tensor([vocab.index(c) for c in text])
    data = Windows(ids, args.context, 8)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=1)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    model = GRULM(len(vocab), args.d_model, 2, dropout=0.1)
    if world > 1:
        model = DDP(model)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)

    def lr_at(step: int) -> float:
        if step < 20:
            return (step + 1) / 20
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - 20) / 1000)))

    sched = torch.optim.lr_scheduler.LambdaLR(optim, lr_at)
    return model, optim, sched, loader, sampler


def batches(loader: DataLoader, sampler: DistributedSampler):  # type: ignore[no-untyped-def]
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def train_step(model, optim, sched, x, y) -> torch.Tensor:  # type: ignore[no-untyped-def]
    logits = model(x)
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
    loss.backward()
    return loss


def finish_step(model, optim, sched) -> None:  # type: ignore[no-untyped-def]
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optim.step()
    sched.step()
    optim.zero_grad()


def write(out: Path, name: str, data: dict) -> None:  # type: ignore[type-arg]
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps(data))


def run_gpufleet(args: argparse.Namespace, out: Path) -> None:
    import gpufleet

    every = str(args.ckpt_every) if args.ckpt_every else str(10**9)  # never, within the run
    run = gpufleet.init(checkpoint_every=every)
    if args.micro:
        micro(run, args.micro, out)
        return
    model, optim, sched, loader, sampler = build(args, run.rank, run.world_size)
    data = gpufleet.resumable(loader)
    run.restore({"model": model, "optim": optim, "sched": sched, "data": data, "rng": gpufleet.RNGState()})
    ends: list[float] = []
    cpu: list[float] = []
    for _step in run.steps(args.steps):
        x, y = next(data)
        loss = train_step(model, optim, sched, x, y)
        run.log(loss=loss)
        finish_step(model, optim, sched)
        ends.append(time.perf_counter())
        cpu.append(time.process_time())
    if run.rank == 0:
        write(out, "steps.json", info(ends, cpu))
    run.finish()


def micro(run, n: int, out: Path) -> None:  # type: ignore[no-untyped-def]
    run.restore({"w": torch.zeros(1)})
    vec = torch.zeros(4, dtype=torch.float64)
    for _ in range(20):
        dist.all_reduce(vec)
    t0 = time.perf_counter()
    for _ in range(n):
        dist.all_reduce(vec)
    allreduce = time.perf_counter() - t0
    total = 3 * n + 40
    it = run.steps(total)
    for _ in range(20):  # warm-up
        next(it)
    t0 = time.perf_counter()
    for _ in range(n):
        next(it)
    empty = time.perf_counter() - t0
    for _ in range(20):
        next(it)
        run.log(loss=1.0)
    t0 = time.perf_counter()
    for _ in range(n):
        next(it)
        run.log(loss=1.0)
    logged = time.perf_counter() - t0
    for _ in it:
        pass
    if run.rank == 0:
        us = 1e6 / n
        write(
            out,
            "micro.json",
            {
                "n": n,
                "allreduce_us": allreduce * us,
                "step_empty_us": empty * us,
                "step_log_us": logged * us,
            },
        )
    run.finish()


def run_torchrun(args: argparse.Namespace, out: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optim, sched, loader, sampler = build(args, rank, world)
    it = batches(loader, sampler)
    ends: list[float] = []
    cpu: list[float] = []
    for step in range(args.steps):
        x, y = next(it)
        loss = train_step(model, optim, sched, x, y)
        float(loss.item())  # a user logs the loss
        finish_step(model, optim, sched)
        if args.ckpt_every and (step + 1) % args.ckpt_every == 0:
            msd, osd = get_state_dict(model, optim)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(out / "ckpt" / f"step_{step + 1}"))
        ends.append(time.perf_counter())
        cpu.append(time.process_time())
    if rank == 0:
        write(out, "steps.json", info(ends, cpu))
    dist.barrier()
    dist.destroy_process_group()


def info(ends: list[float], cpu: list[float]) -> dict:  # type: ignore[type-arg]
    return {
        "ends": ends,
        "cpu": cpu,
        "threads": torch.get_num_threads(),
        "omp": os.environ.get("OMP_NUM_THREADS"),
        "cpus": sorted(os.sched_getaffinity(0)),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--launcher", choices=("gpufleet", "torchrun"), required=True)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--ckpt-every", type=int, default=0, help="steps between checkpoints (0: none)")
    ap.add_argument("--chars", type=int, default=6000)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--micro", type=int, default=0, help="gpufleet: measure the run API's per-step cost")
    args = ap.parse_args()
    out = Path(os.environ["BENCH_OUT"])
    if args.launcher == "gpufleet":
        run_gpufleet(args, out)
    else:
        run_torchrun(args, out)


if __name__ == "__main__":
    main()

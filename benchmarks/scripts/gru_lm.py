"""A plain-PyTorch character GRU language model, as a user writes it, adapted to gpufleet's run API.

Two GRU layers with dropout, AdamW, warm-up then cosine decay, a shuffled ``DataLoader`` (seeded
generator) resumed exactly through ``gpufleet.resumable``. No thread pinning. It trains on a short
slice of the shipped Shakespeare text, so it converges (memorises) to a loss near 0.02 in a few
thousand steps and then sits there: the regime in which a linear robust-z spike rule raises false
alarms. Used by ``benchmarks/soak_spike.py``.
"""

from __future__ import annotations

import argparse
import math
from importlib import resources

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

import gpufleet


class Windows(Dataset):
    def __init__(self, ids: torch.Tensor, context: int, stride: int) -> None:
        self.ids, self.context = ids, context
        self.starts = list(range(0, len(ids) - context - 1, stride))

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.starts[i]
        chunk = self.ids[s : s + self.context + 1]
        return chunk[:-1], chunk[1:]


class GRULM(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, dropout: float) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.gru = nn.GRU(d, d, num_layers=layers, dropout=dropout, batch_first=True)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.gru(self.drop(self.emb(x)))
        return self.head(self.drop(h))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument("--chars", type=int, default=6000, help="characters of text to train on")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--stride", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=16, help="sequences per rank per step")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--decay-steps", type=int, default=4000, help="cosine decay to 10%%, then flat")
    ap.add_argument("--checkpoint-every", default="2m")
    args = ap.parse_args()
    torch.manual_seed(0)

    run = gpufleet.init(checkpoint_every=args.checkpoint_every)
    text = (resources.files("gpufleet") / "data" / "shakespeare.txt").read_text()[: args.chars]
    vocab = sorted(set(text))
    ids = torch.tensor([vocab.index(c) for c in text])
    data = Windows(ids, args.context, args.stride)
    sampler = (
        torch.utils.data.DistributedSampler(
            data, num_replicas=run.world_size, rank=run.rank, shuffle=True, seed=1
        )
        if run.world_size > 1
        else None
    )
    loader = DataLoader(
        data,
        batch_size=args.batch_size,
        shuffle=sampler is None,
        sampler=sampler,
        generator=torch.Generator().manual_seed(1),
        drop_last=True,
    )
    model = GRULM(len(vocab), args.d_model, 2, dropout=0.1)
    if run.world_size > 1:
        model = DDP(model)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return (step + 1) / args.warmup
        frac = min(1.0, (step - args.warmup) / max(1, args.decay_steps - args.warmup))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * frac))

    sched = torch.optim.lr_scheduler.LambdaLR(optim, lr_at)
    batches = gpufleet.resumable(loader)
    state = {"model": model, "optim": optim, "sched": sched, "data": batches, "rng": gpufleet.RNGState()}
    run.restore(state)
    for _step in run.steps(args.steps, steps_per_epoch=batches.steps_per_epoch):
        x, y = next(batches)
        logits = model(x)
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        run.log(loss=loss)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        sched.step()
        optim.zero_grad()
    run.finish()


if __name__ == "__main__":
    main()

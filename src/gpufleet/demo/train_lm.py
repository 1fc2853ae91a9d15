"""The demo training job: a tiny character-level GPT on shipped Shakespeare, DDP over gloo.

Run it under the supervisor (``gpufleet run -n 2 -- python -m gpufleet.demo.train_lm``) or on its
own (one process). It is plain PyTorch plus the ~10 lines of the gpufleet Run API, and it is fully
deterministic: with the same ``--seed`` the final weights are bit-identical whether or not the run
crashed, hung or hit a NaN on the way, because data order is a function of the step, and the model,
optimizer, LR schedule, RNG streams and early-stopping state all come back from the checkpoint.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["WarmupCosine", "build_parser", "main"]


class WarmupCosine:
    """LR multiplier: linear warm-up, then cosine decay to ``min_ratio``. A callable object, so
    ``LambdaLR.state_dict()`` stores its fields and a restore can check them."""

    def __init__(self, warmup: int, total: int, min_ratio: float = 0.1):
        self.warmup = max(0, warmup)
        self.total = max(1, total)
        self.min_ratio = min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        frac = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * frac))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gpufleet.demo.train_lm", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=400, help="total optimizer steps (default 400)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--batch-size", type=int, default=32, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--stride", type=int, default=16, help="characters between training windows")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--patience", type=int, default=4, help="early stopping: evaluations without improvement")
    p.add_argument("--text", default="shakespeare.txt", help="a text file shipped in gpufleet/data/")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads per rank (default: OMP_NUM_THREADS, which gpufleet run sets to each "
        "rank's share of the CPUs)",
    )
    p.add_argument(
        "--sample-chars", type=int, default=200, help="characters to generate at the end (0: none)"
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines (a live view shows progress)")
    return p


def _check_args(args: argparse.Namespace) -> None:
    positive = (
        "steps",
        "batch_size",
        "context",
        "stride",
        "d_model",
        "layers",
        "heads",
        "eval_every",
        "threads",
    )
    for name in positive:
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise SystemExit(f"train_lm: --{name.replace('_', '-')} must be >= 1")
    if args.lr <= 0:
        raise SystemExit("train_lm: --lr must be > 0")


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean validation loss. Eval mode: dropout is off, so no RNG is consumed."""
    model.eval()
    try:
        total = sum(float(model(x, y)) * len(x) for x, y in batches)
        return total / sum(len(x) for x, _ in batches)
    finally:
        model.train()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _check_args(args)

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(args.seed)

    import gpufleet
    from gpufleet.demo.data import CharCorpus, load_text
    from gpufleet.demo.model import GPTConfig, TinyGPT

    run = gpufleet.init()

    corpus = CharCorpus.from_text(load_text(args.text), context=args.context, stride=args.stride)
    cfg = GPTConfig(
        vocab_size=len(corpus.vocab),
        context=args.context,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        dropout=args.dropout,
    )
    net = TinyGPT(cfg)  # same init on every rank (same seed); DDP also broadcasts rank 0's weights
    model: torch.nn.Module = net
    if run.world_size > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(net)
    optim = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, WarmupCosine(args.warmup, args.steps))
    stopper = gpufleet.EarlyStopping(patience=args.patience, mode="min", min_delta=1e-3)
    sampler = gpufleet.StepSampler(
        corpus.num_samples, args.batch_size, seed=args.seed, rank=run.rank, world_size=run.world_size
    )
    state: dict[str, Any] = {
        "model": net,
        "optim": optim,
        "sched": sched,
        "rng": gpufleet.RNGState(),
        "stopper": stopper,
        "sampler": sampler,
    }
    start = run.restore(state)
    val_batches = corpus.val_batches(args.batch_size, max_batches=4)

    if run.is_main and not args.quiet:
        print(
            f"train_lm: {net.num_params():,} params, {corpus.num_samples} windows, "
            f"{sampler.steps_per_epoch} steps/epoch, world {run.world_size}, start step {start}",
            flush=True,
        )

    for step in run.steps(args.steps, steps_per_epoch=sampler.steps_per_epoch):
        # Early stopping is checked at the top of the next step, not with a `break` right after the
        # evaluation: by then run.steps() has booked the finished step, so the final checkpoint
        # carries the right step number (and a restart after a stop comes straight back here).
        if stopper.stopped:
            break
        x, y = corpus.batch(sampler.indices(step))
        loss = model(x, y)
        loss.backward()
        run.log(loss=loss.detach())
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optim.step()
        sched.step()
        optim.zero_grad(set_to_none=True)
        if step % args.eval_every == args.eval_every - 1 or step == args.steps - 1:
            val = evaluate(net, val_batches)
            if run.is_main and not args.quiet:
                print(
                    f"train_lm: step {step + 1:>5}  epoch {run.epoch}  loss {loss.item():.4f}  "
                    f"val {val:.4f}  lr {sched.get_last_lr()[0]:.2e}",
                    flush=True,
                )
            stopper.update(val)

    run.finish()

    if run.is_main:
        summary = {"best_val": stopper.best, "stopped_early": stopper.stopped, "params": net.num_params()}
        if args.sample_chars > 0:
            g = torch.Generator().manual_seed(args.seed)
            prompt = corpus.vocab.encode("\n").view(1, 1)
            text = corpus.vocab.decode(net.generate(prompt, args.sample_chars, generator=g)[0])
            summary["sample"] = text
            if not args.quiet:
                print("train_lm: sample:\n" + text, flush=True)
        (run.run_dir / "train_lm_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

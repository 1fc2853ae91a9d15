"""The demo's data: shipped text, a character vocabulary, and fixed windows indexed by sample id.

A sample is a window of ``context + 1`` characters starting at ``i * stride`` in the training part
of the text. Which samples a rank sees at a step is decided by :class:`gpufleet.StepSampler`, so
this module only has to turn a list of sample ids into a batch, the same way every time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources

import torch

__all__ = ["DEFAULT_TEXT", "CharVocab", "CharCorpus", "load_text"]

DEFAULT_TEXT = "shakespeare.txt"


def load_text(name: str = DEFAULT_TEXT) -> str:
    """Read a text file shipped in ``gpufleet/data/`` (package data, no network, no generation)."""
    if "/" in name or "\\" in name or name.startswith("."):
        raise ValueError(f"not a shipped data file name: {name!r}")
    ref = resources.files("gpufleet").joinpath("data", name)
    if not ref.is_file():
        shipped = sorted(
            p.name for p in resources.files("gpufleet").joinpath("data").iterdir() if p.name.endswith(".txt")
        )
        raise FileNotFoundError(f"no shipped text {name!r}; available: {', '.join(shipped) or 'none'}")
    return ref.read_text(encoding="utf-8")


class CharVocab:
    """Sorted characters of a text; ids are positions in that order (stable across runs)."""

    def __init__(self, text: str):
        self.chars: list[str] = sorted(set(text))
        if not self.chars:
            raise ValueError("empty text")
        self.stoi: dict[str, int] = {c: i for i, c in enumerate(self.chars)}

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, s: str) -> torch.Tensor:
        try:
            return torch.tensor([self.stoi[c] for c in s], dtype=torch.long)
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the vocabulary") from None

    def decode(self, ids: torch.Tensor | Sequence[int]) -> str:
        vals = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return "".join(self.chars[i] for i in vals)


@dataclass
class CharCorpus:
    """The encoded text split into a training part and a held-out validation tail."""

    vocab: CharVocab
    train: torch.Tensor
    val: torch.Tensor
    context: int
    stride: int

    @classmethod
    def from_text(
        cls, text: str, context: int = 64, stride: int = 16, val_fraction: float = 0.1
    ) -> CharCorpus:
        if context < 1 or stride < 1:
            raise ValueError("context and stride must be >= 1")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        vocab = CharVocab(text)
        ids = vocab.encode(text)
        n_val = int(len(ids) * val_fraction)
        corpus = cls(vocab, ids[:-n_val], ids[-n_val:], context, stride)
        if corpus.num_samples < 1 or len(corpus.val) <= context:
            raise ValueError(f"text too short ({len(text)} chars) for context {context}")
        return corpus

    @property
    def num_samples(self) -> int:
        """Number of training windows (the sampler's ``num_samples``)."""
        return (len(self.train) - self.context - 1) // self.stride + 1

    def batch(self, indices: Sequence[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-character targets, each ``(len(indices), context)``."""
        idx = torch.as_tensor(indices, dtype=torch.long).reshape(-1)
        if len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= self.num_samples):
            raise IndexError(f"sample index out of range [0, {self.num_samples})")
        starts = idx * self.stride
        offs = torch.arange(self.context + 1)
        windows = self.train[starts[:, None] + offs[None, :]]
        return windows[:, :-1], windows[:, 1:]

    def val_batches(self, batch_size: int, max_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Fixed, non-overlapping validation windows from the start of the held-out tail."""
        n = min((len(self.val) - 1) // self.context, batch_size * max_batches)
        out = []
        for b0 in range(0, n, batch_size):
            starts = torch.arange(b0, min(n, b0 + batch_size)) * self.context
            w = self.val[starts[:, None] + torch.arange(self.context + 1)[None, :]]
            out.append((w[:, :-1], w[:, 1:]))
        return out

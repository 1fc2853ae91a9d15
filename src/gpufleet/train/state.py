"""Small stateful helpers for exact resume: RNG state, a step-indexed sampler, early stopping.

Each has ``state_dict``/``load_state_dict`` so it can go into the dict given to ``run.restore``.
"""

from __future__ import annotations

import random
from typing import Any

import torch

__all__ = ["RNGState", "StepSampler", "EarlyStopping"]


class RNGState:
    """Captures and restores this rank's Python, NumPy, torch CPU and CUDA generators.

    Saved per rank: every rank's stream differs (dropout masks, augmentation).
    """

    per_rank = True  # the Run API keys this entry by rank

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
        try:
            import numpy as np

            sd["numpy"] = np.random.get_state()
        except ImportError:  # numpy is a dependency, but a missing one should not break saving
            pass
        if torch.cuda.is_available():
            sd["cuda"] = torch.cuda.get_rng_state_all()
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        random.setstate(_as_tuple(sd["python"]))
        torch.set_rng_state(sd["torch"])
        if "numpy" in sd:
            import numpy as np

            np.random.set_state(_as_tuple(sd["numpy"]))
        if "cuda" in sd and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(sd["cuda"])


def _as_tuple(x: Any) -> Any:
    # Round trips through serialisation may turn tuples into lists.
    if isinstance(x, list):
        return tuple(_as_tuple(v) for v in x)
    return x


class StepSampler:
    """Sample indices as a pure function of the global step: resume is exact by construction.

    Epoch ``e`` uses a permutation seeded by ``seed + e``; global step ``s`` is batch ``s % steps_per_epoch``
    of epoch ``s // steps_per_epoch``. Each rank takes a disjoint slice of the global batch.
    """

    def __init__(
        self, num_samples: int, batch_size: int, *, seed: int = 0, rank: int = 0, world_size: int = 1
    ):
        if num_samples <= 0 or batch_size <= 0:
            raise ValueError("num_samples and batch_size must be positive")
        if batch_size * world_size > num_samples:
            raise ValueError("global batch (batch_size x world_size) exceeds the dataset")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.steps_per_epoch = num_samples // (batch_size * world_size)
        self._perm_epoch = -1
        self._perm: torch.Tensor | None = None

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._perm = torch.randperm(self.num_samples, generator=g)
            self._perm_epoch = epoch
        assert self._perm is not None
        return self._perm

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch

    def indices(self, step: int) -> list[int]:
        epoch, batch = divmod(step, self.steps_per_epoch)
        gb = self.batch_size * self.world_size
        start = batch * gb + self.rank * self.batch_size
        return self._permutation(epoch)[start : start + self.batch_size].tolist()

    # Stateless by design; these exist so the sampler can sit in the restore dict harmlessly.
    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "num_samples": self.num_samples, "batch_size": self.batch_size}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.get("num_samples") != self.num_samples or sd.get("batch_size") != self.batch_size:
            raise ValueError("sampler shape changed since the checkpoint; resume would not be exact")
        self.seed = int(sd["seed"])
        self._perm_epoch = -1


class EarlyStopping:
    """Stop when a validation metric has not improved for ``patience`` evaluations. Resumable."""

    def __init__(self, patience: int = 3, *, mode: str = "min", min_delta: float = 0.0):
        if patience < 1:
            raise ValueError("patience must be >= 1")
        if mode not in ("min", "max"):
            raise ValueError("mode must be 'min' or 'max'")
        self.patience = patience
        self.mode = mode
        self.min_delta = min_delta
        self.best: float | None = None
        self.bad_evals = 0
        self.stopped = False

    def update(self, value: float) -> bool:
        """Record one evaluation; return True when training should stop."""
        v = float(value)
        better = self.best is None or (
            v < self.best - self.min_delta if self.mode == "min" else v > self.best + self.min_delta
        )
        if better:
            self.best = v
            self.bad_evals = 0
        else:
            self.bad_evals += 1
        self.stopped = self.bad_evals >= self.patience
        return self.stopped

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "bad_evals": self.bad_evals, "stopped": self.stopped}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.best = sd["best"]
        self.bad_evals = int(sd["bad_evals"])
        self.stopped = bool(sd["stopped"])

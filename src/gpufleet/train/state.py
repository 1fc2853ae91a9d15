"""Small stateful helpers for exact resume: RNG state, a step-indexed sampler, early stopping.

Each has ``state_dict``/``load_state_dict`` so it can go into the dict given to ``run.restore``.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import torch

__all__ = ["RNGState", "StepSampler", "EarlyStopping"]


class RNGState:
    """Captures and restores this rank's Python, NumPy, torch CPU and CUDA generators.

    Saved per rank: every rank's stream differs (dropout masks, augmentation).
    """

    per_rank = True  # the Run API keys this entry by rank

    def resume_without_state(self, step: int, rank: int) -> None:
        """The checkpoint has no state for this rank (it was saved by fewer workers): seed every
        generator from (step, rank), so the resumed run is reproducible and each rank's stream differs."""
        seed = int.from_bytes(hashlib.sha256(f"gpufleet-rng/{step}/{rank}".encode()).digest()[:8], "little")
        seed &= (1 << 63) - 1
        random.seed(seed)
        torch.manual_seed(seed)  # CUDA generators too
        try:
            import numpy as np

            np.random.seed(seed % (1 << 32))
        except ImportError:
            pass

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
    """Sample indices as a function of the global step, positioned in global samples: resume is exact,
    at the same or at another world size.

    Epoch ``e`` reads a permutation of the dataset seeded by ``seed + e``. Each step takes the next
    global batch of it (``batch_size`` x ``world_size`` samples) and rank ``r`` takes the ``r``-th
    ``batch_size`` slice of that batch; an epoch ends when less than a global batch is left (that tail
    is not trained, as with ``drop_last``). Without a world-size change, step ``s`` is batch
    ``s % steps_per_epoch`` of epoch ``s // steps_per_epoch``.

    The state saved with a checkpoint is the position in samples (an anchor step, its epoch and sample
    offset in that epoch's permutation) and the global batch size. Restored under another global
    batch (``-n`` changed, or ``batch_size``), the first step asked for afterwards (the resume step
    ``K``) is placed where the saving run would have been at ``K``: the same epoch permutation at the
    exact next sample, so across the change no sample is repeated or skipped. Epochs after the change
    have ``num_samples // (batch_size * world_size)`` steps.
    """

    def __init__(
        self, num_samples: int, batch_size: int, *, seed: int = 0, rank: int = 0, world_size: int = 1
    ):
        if num_samples <= 0 or batch_size <= 0:
            raise ValueError("num_samples and batch_size must be positive")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        if batch_size * world_size > num_samples:
            raise ValueError("global batch (batch_size x world_size) exceeds the dataset")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.global_batch = batch_size * world_size
        self.steps_per_epoch = num_samples // self.global_batch
        self._anchor = (0, 0, 0)  # (step, epoch, sample offset in the epoch) of a known position
        self._saved: dict[str, Any] | None = None  # loaded under another global batch: placed lazily
        self._perm_epoch = -1
        self._perm: torch.Tensor | None = None

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._perm = torch.randperm(self.num_samples, generator=g)
            self._perm_epoch = epoch
        assert self._perm is not None
        return self._perm

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, offset in that epoch's permutation) of the first sample of global step ``step``."""
        if self._saved is not None:  # first step after a restore under another global batch
            saved, self._saved = self._saved, None
            self._anchor = (step, *_locate(step, self.num_samples, saved["global_batch"], saved["anchor"]))
        if step < self._anchor[0]:
            raise ValueError(f"step {step} is before the step this sampler resumed at ({self._anchor[0]})")
        return _locate(step, self.num_samples, self.global_batch, self._anchor)

    def epoch_of(self, step: int) -> int:
        return self.position(step)[0]

    def indices(self, step: int) -> list[int]:
        """This rank's sample indices for global step ``step``."""
        epoch, offset = self.position(step)
        start = offset + self.rank * self.batch_size
        return self._permutation(epoch)[start : start + self.batch_size].tolist()

    def state_dict(self) -> dict[str, Any]:
        if self._saved is not None:  # not placed yet: the loaded state still describes the position
            return dict(self._saved)
        return {
            "seed": self.seed,
            "num_samples": self.num_samples,
            "batch_size": self.batch_size,
            "global_batch": self.global_batch,
            "anchor": list(self._anchor),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.get("num_samples") != self.num_samples:
            raise ValueError(
                f"the dataset changed since the checkpoint ({sd.get('num_samples')} -> {self.num_samples} "
                "samples); resume would not be exact"
            )
        self.seed = int(sd["seed"])
        self._perm_epoch = -1
        # checkpoints from before the position was saved: same geometry, anchored at step 0
        global_batch = int(sd.get("global_batch", self.global_batch))
        anchor = tuple(int(v) for v in sd.get("anchor", (0, 0, 0)))
        if len(anchor) != 3:
            raise ValueError(f"bad sampler anchor {sd.get('anchor')!r}")
        if global_batch == self.global_batch:
            self._anchor, self._saved = anchor, None  # type: ignore[assignment]
        else:
            self._saved = {**sd, "global_batch": global_batch, "anchor": list(anchor)}


def _locate(step: int, num_samples: int, global_batch: int, anchor: Any) -> tuple[int, int]:
    """(epoch, offset) of ``step`` when steps of ``global_batch`` samples run on from ``anchor``."""
    step0, epoch0, offset0 = (int(v) for v in anchor)
    d = step - step0
    left = (num_samples - offset0) // global_batch  # steps still in the anchor's epoch
    if d < left:
        return epoch0, offset0 + d * global_batch
    d -= left
    per_epoch = num_samples // global_batch
    return epoch0 + 1 + d // per_epoch, (d % per_epoch) * global_batch


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

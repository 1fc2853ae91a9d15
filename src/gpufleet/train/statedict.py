"""Turn the user's dict of stateful objects into one checkpointable state dict, and back.

Modules and optimizers go through ``torch.distributed.checkpoint.state_dict`` so DDP/FSDP wrappers
are unwrapped and optimizer state exists before the first step (needed to load in place).
Objects marked ``per_rank`` (RNG state) are stored under ``<name>.rank<R>``; plain values are stored
as they are and replaced in the user's dict on restore.

Resuming at another world size (a checkpoint saved by W workers, resumed by W'):
- modules and optimizers, sharded (FSDP2/DTensor) or replicated (DDP), are resharded by DCP;
- a per-rank object takes the state saved by the same rank when there is one. A rank the saving run
  did not have (r >= W) calls the object's ``resume_without_state(step, rank)``: ``RNGState`` seeds its
  generators from (step, rank), deterministically. A per-rank object without that method (a
  ``gpufleet.resumable`` loader: its position is per rank) refuses the change with a ConfigError,
  on every rank, since its saved positions do not describe the new ranks' shards of the data.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.utils.data import DataLoader

from gpufleet.core.errors import ConfigError

__all__ = ["StateMapper"]


class StateMapper:
    def __init__(self, state: dict[str, Any], rank: int) -> None:
        if not isinstance(state, dict) or not state:
            raise ConfigError("run.restore() needs a non-empty dict of stateful objects")
        for k in state:
            if not isinstance(k, str) or "." in k or k.startswith("_gpufleet"):
                raise ConfigError(f"state key {k!r} must be a string without dots (and not _gpufleet*)")
        for k, v in state.items():
            if isinstance(v, DataLoader) and not hasattr(v, "state_dict"):
                raise ConfigError(
                    f"state[{k!r}] is a DataLoader, whose position cannot be saved: put "
                    f"gpufleet.resumable(loader) there and take batches from it with next()"
                )
        self.state = state
        self.rank = rank
        modules = [k for k, v in state.items() if isinstance(v, torch.nn.Module)]
        optims = [k for k, v in state.items() if isinstance(v, torch.optim.Optimizer)]
        if optims and len(modules) != 1:
            raise ConfigError("put exactly one model next to the optimizer(s) in the restore dict")
        self._model_key = modules[0] if modules else None
        self.optimizers = [state[k] for k in optims]

    @property
    def model(self) -> torch.nn.Module | None:
        return self.state[self._model_key] if self._model_key else None

    def _rank_key(self, name: str) -> str:
        return f"rank{self.rank}"

    def rank_entries(self) -> list[tuple[str, str]]:
        """``(name, rank key)`` of this rank's per-rank entries; a checkpoint by fewer ranks lacks them."""
        return [(k, self._rank_key(k)) for k, v in self.state.items() if getattr(v, "per_rank", False)]

    def check_world_size(self, saved: int | None, world_size: int) -> None:
        """ConfigError when the checkpoint's world size differs and a per-rank object cannot follow."""
        if saved is None or saved == world_size:
            return
        stuck = [
            k
            for k, v in self.state.items()
            if getattr(v, "per_rank", False) and not callable(getattr(v, "resume_without_state", None))
        ]
        if stuck:
            raise ConfigError(
                f"the checkpoint was saved by {saved} workers and this run has {world_size}: "
                f"state[{stuck[0]!r}] keeps a position per rank, which does not carry over to another "
                f"number of workers (resuming would repeat or skip samples). Resume with -n {saved}, or "
                f"index the data with gpufleet.StepSampler, whose position is in global samples"
            )

    def collect(self) -> dict[str, Any]:
        """The current state as a nested dict of tensors and plain values (references, not copies)."""
        sd: dict[str, Any] = {}
        for name, obj in self.state.items():
            if isinstance(obj, torch.nn.Module):
                sd[name] = get_model_state_dict(obj)
            elif isinstance(obj, torch.optim.Optimizer):
                assert self.model is not None
                sd[name] = get_optimizer_state_dict(self.model, obj)
            elif getattr(obj, "per_rank", False):
                sd[name] = {self._rank_key(name): obj.state_dict()}
            elif hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"):
                sd[name] = obj.state_dict()
            else:
                sd[name] = obj
        return sd

    def apply(self, sd: dict[str, Any], *, step: int = 0) -> None:
        """Load ``sd`` (as returned by the checkpoint engine) back into the objects. ``step``: the
        checkpoint's step, from which a rank without saved per-rank state derives its own."""
        for name, obj in list(self.state.items()):
            if name not in sd:
                if getattr(obj, "per_rank", False) and callable(getattr(obj, "resume_without_state", None)):
                    obj.resume_without_state(step, self.rank)  # the engine dropped this rank's absent entry
                continue
            value = sd[name]
            if isinstance(obj, torch.nn.Module):
                set_model_state_dict(obj, value)
            elif isinstance(obj, torch.optim.Optimizer):
                assert self.model is not None
                set_optimizer_state_dict(self.model, obj, value)
            elif getattr(obj, "per_rank", False):
                mine = value.get(self._rank_key(name)) if isinstance(value, dict) else None
                if mine is not None:
                    obj.load_state_dict(mine)
                else:  # saved by fewer ranks than this run has (check_world_size vetted the object)
                    obj.resume_without_state(step, self.rank)
            elif hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"):
                obj.load_state_dict(value)
            else:
                self.state[name] = value

    def deferred_keys(self) -> Callable[[str], bool]:
        """Flattened keys whose copy may overlap the next forward/backward: parameters and optimizer state.

        They only change inside ``optimizer.step()``, which waits for the copy. Buffers (BatchNorm
        statistics) change during forward, so they are copied before ``save()`` returns.
        """
        params: set[str] = set()
        if self._model_key is not None:
            model = self.model
            assert model is not None
            inner = getattr(model, "module", model)
            params = {f"{self._model_key}.{n}" for n, _ in inner.named_parameters()}
        optim_prefixes = tuple(
            f"{k}.state." for k, v in self.state.items() if isinstance(v, torch.optim.Optimizer)
        )

        def deferred(key: str) -> bool:
            return key in params or (bool(optim_prefixes) and key.startswith(optim_prefixes))

        return deferred

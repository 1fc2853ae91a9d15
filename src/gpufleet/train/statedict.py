"""Turn the user's dict of stateful objects into one checkpointable state dict, and back.

Modules and optimizers go through ``torch.distributed.checkpoint.state_dict`` so DDP/FSDP wrappers
are unwrapped and optimizer state exists before the first step (needed to load in place).
Objects marked ``per_rank`` (RNG state) are stored under ``<name>.rank<R>``; plain values are stored
as they are and replaced in the user's dict on restore.

Resuming at another world size (a checkpoint saved by W workers, resumed by W'):
- modules and optimizers, sharded (FSDP2/DTensor) or replicated (DDP), are resharded by DCP;
- a per-rank object with ``shared_state_dict``/``load_shared_state_dict`` (``gpufleet.resumable`` with
  a ``DistributedSampler``: the position in global samples, saved next to the per-rank entries
  under ``<name>.shared``) resumes on every rank from that shared position;
- else it takes the state saved by the same rank when there is one, and a rank the saving run did
  not have (r >= W) calls the object's ``resume_without_state(step, rank)``: ``RNGState`` seeds its
  generators from (step, rank), deterministically;
- a per-rank object with neither (a ``gpufleet.resumable`` loader without a DistributedSampler: its
  position is per rank) refuses the change with a ConfigError on every rank.
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

_SHARED = "shared"  # next to ``rank<R>``: a per-rank object's position that is equal on every rank


def _follow(obj: Any) -> str | None:
    """How a per-rank object follows a changed world size: "shared" (from the position all ranks
    share), "derive" (own saved state, or one derived for a new rank), or None (it cannot)."""
    if callable(getattr(obj, "load_shared_state_dict", None)) and getattr(obj, "follows_world_size", True):
        return "shared"
    if callable(getattr(obj, "resume_without_state", None)):
        return "derive"
    return None


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
        self._resharding = False  # set by check_world_size: the checkpoint came from another world size
        self.optimizers = [state[k] for k in optims]

    @property
    def model(self) -> torch.nn.Module | None:
        return self.state[self._model_key] if self._model_key else None

    def _rank_key(self, name: str) -> str:
        return f"rank{self.rank}"

    def rank_entries(self) -> list[tuple[str, str]]:
        """``(name, key)`` of this rank's per-rank entries, and of the shared positions next to them: a
        checkpoint saved by fewer ranks (or before shared positions were saved) lacks them."""
        out: list[tuple[str, str]] = []
        for k, v in self.state.items():
            if getattr(v, "per_rank", False):
                out.append((k, self._rank_key(k)))
                if callable(getattr(v, "shared_state_dict", None)):
                    out.append((k, _SHARED))
        return out

    def check_world_size(self, saved: int | None, world_size: int) -> None:
        """ConfigError when the checkpoint's world size differs and a per-rank object cannot follow."""
        if saved is None or saved == world_size:
            return
        stuck = [k for k, v in self.state.items() if getattr(v, "per_rank", False) and _follow(v) is None]
        if stuck:
            raise ConfigError(
                f"the checkpoint was saved by {saved} workers and this run has {world_size}: "
                f"state[{stuck[0]!r}] keeps a position per rank, which does not carry over to another "
                f"number of workers (resuming would repeat or skip samples). Resume with -n {saved}, give "
                f"the loader a DistributedSampler, or index the data with gpufleet.StepSampler"
            )
        self._resharding = True

    def drop_gradients(self) -> None:
        """Every gradient of the model to None, as a fresh process has them (a discarded step's)."""
        if self.model is not None:
            for p in self.model.parameters():
                p.grad = None

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
                if callable(getattr(obj, "shared_state_dict", None)):
                    sd[name][_SHARED] = obj.shared_state_dict()  # equal on every rank: DCP keeps one
            elif hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"):
                sd[name] = obj.state_dict()
            else:
                sd[name] = obj
        return sd

    def prime_optimizers(self, metadata: Any) -> list[torch.optim.Optimizer]:
        """Give every optimizer that has no state yet the state tensors the checkpoint holds for it,
        allocated empty with the shapes and dtypes of its DCP ``metadata``; return those primed.

        Without this, building the load's template (``collect``) makes torch run a fake optimizer
        step with zero gradients (``_init_optim_state``): for AdamW a full update pass over every
        parameter that a restart waits for, only to have its result overwritten by the load. The
        load fills every primed tensor; when it loads nothing, call :meth:`unprime` so the first real
        step starts the state. Plain and DDP models only: a sharded (DTensor) parameter, a state
        entry stored as bytes or a name that does not map to one parameter leaves the optimizer to
        torch (nothing primed)."""
        model = self.model
        if model is None or metadata is None or not self.optimizers:
            return []
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata
        from torch.distributed.checkpoint.state_dict import _get_fqns
        from torch.distributed.tensor import DTensor

        fqn_of: dict[torch.nn.Parameter, str] = {}
        for name, param in model.named_parameters():
            fqns = _get_fqns(model, name)
            if isinstance(param, DTensor) or len(fqns) != 1:
                return []
            fqn_of[param] = next(iter(fqns))
        entries = getattr(metadata, "state_dict_metadata", {})
        primed: list[torch.optim.Optimizer] = []
        for key, opt in self.state.items():
            if not isinstance(opt, torch.optim.Optimizer) or opt.state:
                continue
            prefix = f"{key}.state."
            saved: dict[str, dict[str, Any]] = {}  # fqn -> state name -> storage metadata
            for k, md in entries.items():
                if k.startswith(prefix):
                    fqn, _, name = k[len(prefix) :].rpartition(".")
                    saved.setdefault(fqn, {})[name] = md
            state: dict[torch.nn.Parameter, dict[str, torch.Tensor]] = {}
            for group in opt.param_groups:
                for param in group["params"]:
                    fqn = fqn_of.get(param)
                    if fqn is None:
                        return self.unprime(primed)
                    items = saved.get(fqn, {})
                    if not all(isinstance(md, TensorStorageMetadata) for md in items.values()):
                        return self.unprime(primed)
                    # 0-d entries (Adam's step) live on the CPU unless the optimizer moves them:
                    # its own load_state_dict puts each value where it wants it.
                    state[param] = {
                        n: torch.empty(
                            md.size, dtype=md.properties.dtype, device=param.device if len(md.size) else "cpu"
                        )
                        for n, md in items.items()
                    }
            for param, values in state.items():
                if values:
                    opt.state[param] = values
            if opt.state:
                primed.append(opt)
        return primed

    @staticmethod
    def unprime(primed: list[torch.optim.Optimizer]) -> list[torch.optim.Optimizer]:
        """Drop the (unloaded) state :meth:`prime_optimizers` gave these optimizers; returns []."""
        for opt in primed:
            opt.state.clear()
        return []

    def apply(self, sd: dict[str, Any], *, step: int = 0) -> None:
        """Load ``sd`` (as returned by the checkpoint engine) back into the objects. ``step``: the
        checkpoint's step, from which a rank without saved per-rank state derives its own. Call
        :meth:`check_world_size` first: it decides how per-rank objects follow a changed world size."""
        for name, obj in list(self.state.items()):
            value = sd.get(name)
            if getattr(obj, "per_rank", False):
                self._apply_per_rank(name, obj, value if isinstance(value, dict) else {}, step)
                continue
            if name not in sd:
                continue
            if isinstance(obj, torch.nn.Module):
                set_model_state_dict(obj, value)
            elif isinstance(obj, torch.optim.Optimizer):
                assert self.model is not None
                set_optimizer_state_dict(self.model, obj, value)
            elif hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"):
                obj.load_state_dict(value)
            else:
                self.state[name] = value

    def _apply_per_rank(self, name: str, obj: Any, value: dict[str, Any], step: int) -> None:
        mine = value.get(self._rank_key(name))
        how = _follow(obj) if self._resharding else None
        if how == "shared":
            if _SHARED not in value:
                raise ConfigError(
                    f"state[{name!r}]: the checkpoint predates positions in global samples; "
                    "resume it with the number of workers that saved it"
                )
            obj.load_shared_state_dict(value[_SHARED])
        elif mine is not None:
            obj.load_state_dict(mine)
        elif how == "derive":  # a rank the saving run did not have
            obj.resume_without_state(step, self.rank)
        else:
            raise ConfigError(f"the checkpoint has no state[{name!r}] for rank {self.rank}")

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

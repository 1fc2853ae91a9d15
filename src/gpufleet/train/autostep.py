"""Step telemetry for a script that never calls gpufleet: a global optimizer step hook.

``gpufleet run`` puts ``gpufleet/train/_autostart`` first on each rank's ``PYTHONPATH`` and sets
``GPUFLEET_AUTO_TELEMETRY=1``. Python imports the ``sitecustomize`` module found there at start-up,
which calls :func:`activate`. That imports no torch: it puts a finder on ``sys.meta_path`` that
waits for ``torch.optim.optimizer``; once the script's own ``import torch`` has run that module, the
finder registers :func:`torch.optim.optimizer.register_optimizer_step_post_hook`. From then on every
``optimizer.step()`` of the script's first optimizer (the *lead* one) is a training step:

- every rank sends a step heartbeat (``hb``) on the channel the supervisor gave it
  (``GPUFLEET_CONTROL_FD``), so hangs are detected as for a script that calls ``gpufleet.init()``;
  from its second step on it carries the step's timings for the straggler detector
  (:mod:`gpufleet.train.straggler`): ``work``, from the last step's end to this one's, less the
  ``torch.save`` stall, and ``fwd``, from the last step's end to the end of the step's first forward
  of a ``DistributedDataParallel`` model (a forward hook that a global module-registration hook puts
  on each DDP instance as it is built). Under DDP every rank ends its step together, so ``fwd`` is the
  one that shows a rank slow in its data loading or forward;
- rank 0 sends a ``step`` event (the ledger's progress, goodput and MTTR come from these) and, for
  each ``torch.save`` to a path (a file name, not a buffer) that returned, a ``ckpt_committed``
  event with the path, the bytes written and the save's duration, which is also the next step's
  ``stall``.

Step numbers: an optimizer that keeps a step count in its state (Adam, AdamW, RMSprop, Adagrad ...)
gives the step it resumed at after the script loaded its snapshot, read once at the first step; an
optimizer that keeps none (SGD) counts from 0 in every process.

A script that calls ``gpufleet.init()`` reports through its :class:`~gpufleet.train.run.Run`:
``Run`` calls :func:`yield_to_api`, which removes the hook, so no step is counted twice.
Everything here is best effort: an error in the hook turns it off and never reaches the script.
"""

from __future__ import annotations

import atexit
import importlib.abc
import importlib.machinery
import os
import sys
import time
import weakref
from types import ModuleType
from typing import Any

from gpufleet.core.env import Env, Platform

__all__ = ["activate", "yield_to_api", "install", "uninstall", "active", "mark_step", "AUTOSTART_DIR"]

AUTOSTART_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_autostart")
"""The directory ``gpufleet run`` prepends to each rank's ``PYTHONPATH`` (its ``sitecustomize``)."""

_TARGET = "torch.optim.optimizer"


class _Hook:
    """What the hook knows: the lead optimizer, the step it is at, the pending save stall."""

    def __init__(self) -> None:
        self.handle: Any = None  # torch's RemovableHandle of the global step hook
        self.ddp_handle: Any = None  # the global module-registration hook that times DDP forwards
        self.fwd: float | None = None  # this step's first DDP forward ended this long after its start
        self.lead: weakref.ref[Any] | None = None
        self.step = -1
        self.last_t: float | None = None  # monotonic time of the lead optimizer's last step
        self.stall = 0.0  # seconds of torch.save since the last step
        self.pending: tuple[int, float] | None = None  # rank 0's first step: (step, wall t), dt unknown yet
        self.sink: Any = None
        self.rank = 0
        self.fd: int | None = None
        self.saved_fn: Any = None  # the torch.save the wrapper replaced
        self.off = False  # yielded to the API, or the channel failed
        self.explicit = False  # the script calls gpufleet.step(): the optimizer hook stands down

    # ------------------------------------------------------------------ the step hook
    def after_step(self, opt: Any, args: Any, kwargs: Any) -> None:
        if self.off or self.explicit:
            return
        try:
            lead = self.lead() if self.lead is not None else None
            if lead is None:  # the first step, or the lead optimizer is gone (a new one made on resume)
                self.lead = weakref.ref(opt)
                resumed = _state_step(opt)
                self.advance(resumed - 1 if resumed is not None else self.step + 1)
            elif lead is opt:
                self.advance(self.step + 1)
            # else: a second optimizer (a GAN's other one) in the same training step
        except Exception:  # noqa: BLE001 - telemetry must never break the script's step
            self.stop()

    def advance(self, step: int) -> None:
        """Step ``step`` has finished: the heartbeat, and on rank 0 the ``step`` event."""
        self.step = step
        now = time.monotonic()
        if not self._channel():
            return
        from gpufleet.core import events as E

        if self.saved_fn is None and "torch" in sys.modules:
            self.wrap_save(sys.modules["torch"])  # torch.save exists once torch has loaded
        if self.last_t is None:  # the first step's start is unknown: no timings
            self.sink.emit(E.Heartbeat(step=step))
        else:
            work = now - self.last_t - self.stall
            fwd = None if self.fwd is None else round(self.fwd, 6)
            self.sink.emit(E.Heartbeat(step=step, work=round(max(work, 0.0), 6), fwd=fwd))
        self.fwd = None
        if self.rank == 0:
            if self.last_t is None:
                # How long the first step took is unknown (start-up, data loading and the restore ran
                # before it): it is sent with the next step's duration, or at exit with none.
                self.pending = (step, time.time())
            else:
                dt = now - self.last_t
                self._flush_pending(dt)
                self.sink.emit(E.Step(step=step, dt=round(dt, 6), stall=round(min(self.stall, dt), 6)))
        self.stall = 0.0
        self.last_t = now

    def registered(self, module: Any, name: str, submodule: Any) -> None:
        """Global module-registration hook: a ``DistributedDataParallel`` being built (its ``module``
        attribute is set in its constructor) gets the forward hook that times ``fwd``."""
        if self.off or name != "module":
            return
        ddp = sys.modules.get("torch.nn.parallel.distributed")
        if ddp is not None and isinstance(module, ddp.DistributedDataParallel):
            module.register_forward_hook(self.after_forward)

    def after_forward(self, module: Any, args: Any, output: Any) -> None:
        # The step's first forward (gradient accumulation runs several): data loading and forward come
        # before DDP's gradient all-reduce, so a slow rank shows here although every rank ends together.
        if self.fwd is None and self.last_t is not None and not self.off:
            self.fwd = time.monotonic() - self.last_t - self.stall

    def _flush_pending(self, dt: float) -> None:
        if self.pending is None:
            return
        from gpufleet.core import events as E

        step, t = self.pending
        self.pending = None
        self.sink.emit(E.Step(step=step, dt=round(dt, 6), t=t))

    def at_exit(self) -> None:
        """The script has returned: its pending first step, and an ``exit`` heartbeat (the interpreter's
        teardown, which says nothing for seconds, is not a hang)."""
        if self.off or self.sink is None:
            return
        from gpufleet.core import events as E

        try:
            self._flush_pending(0.0)
            self.sink.emit(E.Heartbeat(step=self.step, phase=E.HeartbeatPhase.EXIT))
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing to report to
            pass

    def _channel(self) -> bool:
        """The sink to the supervisor, made at the first step: a standby learns its channel and rank
        only when it is promoted, after start-up."""
        fd = Env.CONTROL_FD.get()
        if fd is None:
            self.stop()
            return False
        rank = Platform.RANK.get()
        if self.sink is None or fd != self.fd or rank != self.rank:
            from gpufleet.core.ledger import PipeSink

            self.sink, self.fd, self.rank = PipeSink(fd, rank), fd, rank
        return True

    # ------------------------------------------------------------------ torch.save
    def wrap_save(self, torch: ModuleType) -> None:
        if self.saved_fn is not None:
            return
        original = torch.save
        hook = self

        def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
            t0 = time.monotonic()
            out = original(obj, f, *args, **kwargs)
            if not hook.off and isinstance(f, str | os.PathLike):
                try:
                    hook.saved(os.fspath(f), time.monotonic() - t0)
                except Exception:  # noqa: BLE001 - the save itself succeeded; telemetry is best effort
                    hook.stop()
            return out

        save.__wrapped__ = original  # type: ignore[attr-defined]
        save.__doc__ = original.__doc__
        self.saved_fn = original
        torch.save = save

    def saved(self, path: str, seconds: float) -> None:
        self.stall += seconds
        if self.lead is None or not self._channel() or self.rank != 0:
            return  # before the first step there is no step to name it by
        from gpufleet.core import events as E

        size = os.path.getsize(path) if os.path.isfile(path) else 0
        self.sink.emit(
            E.CkptCommitted(
                step=self.step, path=os.path.abspath(path), bytes=size, persist_s=round(seconds, 6)
            )
        )

    def stop(self) -> None:
        """Stop reporting and remove the hook (the torch.save wrapper stays, inert)."""
        self.off = True
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        if self.ddp_handle is not None:
            self.ddp_handle.remove()
            self.ddp_handle = None


_HOOK = _Hook()


def _state_step(opt: Any) -> int | None:
    """The step count an optimizer keeps in its state (after this step), if it keeps one."""
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state.get(p)
            if state and "step" in state:
                step = state["step"]
                return int(step.item() if hasattr(step, "item") else step)
    return None


def install(optimizer_module: ModuleType) -> None:
    """Register the global step hook (``optimizer_module``: ``torch.optim.optimizer``)."""
    if _HOOK.handle is not None or _HOOK.off:
        return
    _HOOK.handle = optimizer_module.register_optimizer_step_post_hook(_HOOK.after_step)
    from torch.nn.modules.module import register_module_module_registration_hook

    _HOOK.ddp_handle = register_module_module_registration_hook(_HOOK.registered)
    atexit.register(_HOOK.at_exit)


def uninstall() -> None:
    """Remove the hook and the import watcher, and restore ``torch.save``; start over (tests)."""
    global _HOOK
    _HOOK.stop()
    torch = sys.modules.get("torch")
    if torch is not None and _HOOK.saved_fn is not None:
        torch.save = _HOOK.saved_fn
    atexit.unregister(_HOOK.at_exit)
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Watcher)]
    _HOOK = _Hook()


def mark_step(step: int | None = None) -> None:
    """A training step has finished (``gpufleet.step()``): ``step`` is its 0-based index, or the one
    after the last. From the first call on, this is the script's step count and the optimizer hook
    stands down. Under a script that called ``gpufleet.init()``, or outside ``gpufleet run``, a no-op."""
    if _HOOK.off:
        return
    if not _HOOK.explicit:
        _HOOK.explicit = True
        if _HOOK.handle is not None:
            _HOOK.handle.remove()
            _HOOK.handle = None
        atexit.register(_HOOK.at_exit)
    try:
        _HOOK.advance(_HOOK.step + 1 if step is None else int(step))
    except Exception:  # noqa: BLE001 - telemetry must never break the script
        _HOOK.stop()


def active() -> bool:
    """Whether the step hook is registered and reporting."""
    return _HOOK.handle is not None and not _HOOK.off


def yield_to_api() -> None:
    """The script called ``gpufleet.init()``: its :class:`~gpufleet.train.run.Run` reports the steps."""
    _HOOK.stop()
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Watcher)]


class _Loader(importlib.abc.Loader):
    """Runs the real loader, then installs the hook into the module it made."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.real.create_module(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: ModuleType) -> None:
        # The module's own loader, not this wrapper, for whoever inspects it later (inspect, dynamo).
        module.__loader__ = self.real
        if module.__spec__ is not None:
            module.__spec__.loader = self.real
        self.real.exec_module(module)
        try:
            install(module)
        except Exception:  # noqa: BLE001 - never break the script's `import torch`
            _HOOK.stop()


class _Watcher(importlib.abc.MetaPathFinder):
    """Waits on ``sys.meta_path`` for ``torch.optim.optimizer`` to be imported (one shot)."""

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> Any:
        if fullname != _TARGET:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


def activate() -> None:
    """At interpreter start-up (``sitecustomize``), when ``GPUFLEET_AUTO_TELEMETRY`` is on: hook
    ``optimizer.step`` once torch's optimizers load, or at once if they already have."""
    if not Env.AUTO_TELEMETRY.get() or active():
        return
    loaded = sys.modules.get(_TARGET)
    if loaded is not None:
        install(loaded)
    elif not any(isinstance(f, _Watcher) for f in sys.meta_path):
        sys.meta_path.insert(0, _Watcher())

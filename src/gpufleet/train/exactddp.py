"""Bit-identical resume of ``DistributedDataParallel`` with three or more ranks.

Why it is needed. A new DDP instance all-reduces its first synced backward in one bucket holding every
gradient in registration order; from the second on it uses buckets rebuilt from the order in which
the gradients became ready. A ring all-reduce sums each element in an order set by the element's
position in its bucket: with two ranks ``a + b == b + a`` exactly, with three ``(a + b) + c`` and
``a + (b + c)`` differ in the last bit. So the first step of a resumed attempt (a new DDP) summed
differently from the same step of an unbroken run (rebuilt buckets), and every later step inherited
the difference: a run resumed at 3 or more ranks was not bit-identical to one that never failed.

What it does. A DDP communication hook that does what DDP's built-in path does, bit for bit (scale
each gradient by ``1 / world_size``, all-reduce the bucket), and records the rebuilt layout (the
parameter names of every bucket, as DDP rebuilt them on rank 0 and sent to all). The run saves the
layout in each checkpoint's meta; a resumed attempt's first synced backward all-reduces its gradients
in that layout instead of the single initial bucket, so it sums exactly as the unbroken run did.
The first backward of a fresh run is left as DDP does it: an unbroken run has it too.

In-process restart in place (``gpufleet run --in-process-restart``) uses the same hook with any number
of ranks. A collective that fails because a peer died does not raise out of the user's ``backward``: the
hook records the error and hands back the unreduced bucket, so the step runs to its end and the run
API, at the step boundary, discards it (rolls the state back) and re-forms the group. After that, every
rank's first synced backward replays the checkpoint's layout: a survivor's DDP holds rebuilt buckets, a
hot spare's a fresh one's, and the replay is what makes their all-reduces match.

Not covered (DDP's behaviour is left alone, and the resume is exact only for two ranks, as before):
``static_graph=True``, a user's own communication hook, DDP's mixed precision, and the Python
reducer. ``find_unused_parameters=True`` needs nothing: DDP never rebuilds its buckets then.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

__all__ = ["ExactBuckets", "DDPWatcher"]

Layout = list[list[str]]


class ExactBuckets:
    """The hook's state for one DDP instance: its recorded layout, and the saved one to replay."""

    def __init__(
        self,
        ddp: DistributedDataParallel,
        saved: Layout | None,
        tolerate: Callable[[BaseException], bool] | None = None,
    ) -> None:
        self.ddp = ddp
        self.names = {id(p): n for n, p in ddp.module.named_parameters()}
        self.group = ddp.process_group
        # In-place rejoin: which collective errors to swallow (a dead peer's), and the first one seen.
        self.tolerate = tolerate
        self.errored: BaseException | None = None
        self.scale = 1.0 / self.group.size()  # DDP's built-in path multiplies by this very double
        self.saved = saved
        self.iteration = 0  # synced backwards seen by this instance
        self.layout: Layout | None = None  # the rebuilt buckets, recorded in the second synced backward
        self._current: Layout = []
        self._views: dict[str, torch.Tensor] = {}
        self._pending: list[tuple[torch.futures.Future[torch.Tensor], torch.Tensor]] = []

    def checkpoint_layout(self) -> Layout | None:
        """The layout for the next checkpoint's meta: this attempt's own, else the one it resumed with."""
        return self.layout or self.saved

    def hook(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buf = bucket.buffer()
        buf.mul_(self.scale)
        names = [self.names[id(p)] for p in bucket.parameters()]
        if self.errored is not None:  # the group is broken: the step is discarded anyway
            fut = _done(buf)
        elif self.iteration == 0 and self.saved:  # a resumed attempt's first synced backward
            fut = self._replay(bucket, names, buf)
        else:
            try:
                work = dist.all_reduce(buf, group=self.group, async_op=True)  # as DDP's own path does
                fut = work.get_future().then(lambda f: self._result(f, buf))
            except Exception as e:
                fut = self._failed(e, buf)
        if self.iteration >= 1 and self.layout is None:
            self._current.append(names)
        if bucket.is_last():
            if self.iteration >= 1 and self.layout is None:
                self.layout = self._current
            self.iteration += 1
        return fut

    def _result(self, fut: torch.futures.Future[Any], buf: torch.Tensor) -> torch.Tensor:
        try:
            return fut.value()[0]
        except Exception as e:
            if self.tolerate is None or not self.tolerate(e):
                raise
            self.errored = self.errored or e
            return buf

    def _failed(self, e: Exception, buf: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        if self.tolerate is None or not self.tolerate(e):
            raise e
        self.errored = self.errored or e
        return _done(buf)

    def sync_buffers(self, named_buffers: dict[str, torch.Tensor]) -> None:
        """DDP's own buffer broadcast from rank 0 (each forward), with a dead peer's error absorbed as
        the gradient hook absorbs it: a model with buffers (a causal mask, BatchNorm statistics) meets
        the failure in its forward, before any gradient is all-reduced."""
        if self.errored is not None:
            return
        try:
            self.ddp._default_broadcast_coalesced(authoritative_rank=0)  # what DDP does without a hook
        except Exception as e:
            if self.tolerate is None or not self.tolerate(e):
                raise
            self.errored = e

    def rejoin(self, group: Any, saved: Layout | None) -> None:
        """A new round in place: DDP and this hook on ``group``, and the first synced backward replays
        ``saved`` (the restored checkpoint's layout), as a fresh rank's does."""
        self.ddp._update_process_group(group)  # torch's own API for a DDP whose world is re-formed
        self.group = group
        self.scale = 1.0 / group.size()
        self.saved = saved
        self.iteration = 0
        self.layout = None
        self._current, self._views, self._pending = [], {}, []
        self.errored = None

    def _replay(
        self, bucket: dist.GradBucket, names: list[str], buf: torch.Tensor
    ) -> torch.futures.Future[torch.Tensor]:
        """Hold the initial buckets until the last one, then all-reduce every gradient in the saved
        layout. Every rank decides the same way (same checkpoint, same model), so the collectives match."""
        assert self.saved is not None
        self._views.update(zip(names, bucket.gradients(), strict=True))
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        self._pending.append((fut, buf))
        if not bucket.is_last():
            return fut
        views, self._views = self._views, {}
        if sorted(views) != sorted(n for group in self.saved for n in group):
            groups = [list(views)]  # the model changed since the checkpoint: nothing to match
        else:
            groups = self.saved
        for group in groups:
            flat = torch.cat([views[n].reshape(-1) for n in group])
            if self.errored is None:
                try:
                    dist.all_reduce(flat, group=self.group)
                except Exception as e:
                    if self.tolerate is None or not self.tolerate(e):
                        raise
                    self.errored = e
            offset = 0
            for n in group:
                v = views[n]
                v.copy_(flat[offset : offset + v.numel()].view_as(v))
                offset += v.numel()
        pending, self._pending = self._pending, []
        for f, b in pending:
            f.set_result(b)
        return fut


def _done(buf: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buf)
    return fut


def _buffer_hook(state, named_buffers):  # type: ignore[no-untyped-def]
    state.sync_buffers(named_buffers)  # synchronous, like DDP's default: no futures to install


def _hook(state, bucket):  # type: ignore[no-untyped-def]
    # Unannotated on purpose: DDP compares the annotations with its own types, and this module's
    # are strings (``from __future__ import annotations``).
    return state.hook(bucket)


_watching: DDPWatcher | None = None  # one finder per process: a new round's ends the last one's


def _supported(ddp: DistributedDataParallel) -> bool:
    return not (
        getattr(ddp, "static_graph", False)
        or getattr(ddp, "find_unused_parameters", False)  # no rebuild: the layout never changes
        or getattr(ddp, "_comm_hooks", None)  # the user's own hook: theirs to keep
        or getattr(ddp, "mixed_precision", None) is not None
        or getattr(ddp, "_use_python_reducer", False)
        or getattr(ddp, "_delay_all_reduce_all_params", False)
    )


class DDPWatcher:
    """Finds the DDP instance that wraps the restore dict's model and attaches the hook to it.

    The script may wrap its model before or after ``run.restore``, and put either the DDP or the inner
    module in the dict; so until the first step is done a global forward pre-hook looks at each
    module called, and attaches at the first DDP whose ``module`` is the model (or that is it).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        saved: Layout | None,
        tolerate: Callable[[BaseException], bool] | None = None,
    ) -> None:
        global _watching
        if _watching is not None:  # an in-process restart abandoned a round before its first step
            _watching.stop_watching()
        self.model = model
        self.saved = saved
        self.tolerate = tolerate
        self.exact: ExactBuckets | None = None
        self.foreign = False  # found a DDP it cannot hook (the script's own hook, static graph, ...)
        self._handle: Any = None
        if isinstance(model, DistributedDataParallel):
            self._attach(model)
        else:
            self._handle = torch.nn.modules.module.register_module_forward_pre_hook(self._look)
            _watching = self

    def _look(self, module: torch.nn.Module, args: Any) -> None:
        if isinstance(module, DistributedDataParallel) and module.module is self.model:
            self._attach(module)
            self.stop_watching()

    def _attach(self, ddp: DistributedDataParallel) -> None:
        if self.exact is None and not _supported(ddp):
            self.foreign = True
        if self.exact is None and _supported(ddp):
            if self.tolerate is not None and _stale(ddp.process_group):
                # Built before this round's group (a hot spare's placeholder group, or the group of
                # a round its rank left): DDP on the default group moves to the current one.
                ddp._update_process_group(_default_group())  # torch's API for a re-formed world
            self.exact = ExactBuckets(ddp, self.saved, self.tolerate)
            ddp.register_comm_hook(self.exact, _hook)
            if self.tolerate is not None and not hasattr(ddp, "buffer_hook"):  # not the script's own
                from torch.nn.parallel.distributed import _BufferCommHookLocation

                ddp._register_buffer_comm_hook(
                    self.exact, _buffer_hook, comm_hook_location=_BufferCommHookLocation.PRE_FORWARD
                )

    def errored(self) -> BaseException | None:
        """The collective error the hook swallowed this round (in-place rejoin), if any."""
        return None if self.exact is None else self.exact.errored

    def rejoinable(self) -> bool:
        """Whether the DDP instance (if found) can move to a re-formed default group."""
        return self.exact is not None or self._handle is not None

    def rejoin(self, saved: Layout | None) -> None:
        """The new round's default group for DDP and the hook; the first backward replays ``saved``."""
        self.saved = saved
        if self.exact is not None:
            self.exact.rejoin(_default_group(), saved)

    def stop_watching(self) -> None:
        """After the first step: a script without DDP pays for the global hook no longer."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        global _watching
        if _watching is self:
            _watching = None

    def checkpoint_layout(self) -> Layout | None:
        return self.exact.checkpoint_layout() if self.exact is not None else None


def _default_group() -> Any:
    return dist.group.WORLD


def _stale(group: Any) -> bool:
    """A group that is not this round's default but spans as many ranks (DDP built on an earlier
    round's default group); a subgroup of the script's own making is left alone."""
    current = _default_group()
    if group is current:
        return False
    try:
        return group.size() == current.size()
    except RuntimeError:  # a destroyed group may not answer
        return True

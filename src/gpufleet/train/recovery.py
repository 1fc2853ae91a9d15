"""A Run's recovery in the same process: a hot spare's promotion, and a round rejoined in place.

Under ``--in-process-restart`` (train/inprocess.py) a rank survives a peer's death without unwinding
the script: a collective that fails is noted, the step runs to its boundary and is discarded there,
and the rank leaves the round, reads its order, joins the next and rolls its objects back.
:class:`Recovery` keeps the state this needs apart from the step loop:

- the round's first collective failure (:meth:`Recovery.note_error`), and which failures are
  survivable at all;
- a **hot spare**'s wait for its promotion (it built its objects for one rank, under a placeholder
  group), with each new commit preloaded into them meanwhile (train/held.py);
- the in-place restore from what every rank of the round already holds: a survivor's snapshot, a
  promoted spare's preload;
- the optimizer's parameter lists set aside during a discarded step.

The round's order arrives on stdin (:func:`read_order`); :class:`RebuildRound` sends a rank back to
the harness when it must run its script again.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from gpufleet.core import events as E
from gpufleet.core.env import Platform
from gpufleet.core.errors import RebuildRound
from gpufleet.core.exitcodes import ExitCode
from gpufleet.core.ledger import EventSink
from gpufleet.core.settings import Env, RunSettings
from gpufleet.train.held import Held, Preloader
from gpufleet.train.peerloss import survivable

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from gpufleet.checkpoint import CheckpointEngine
    from gpufleet.train.checkpointing import Checkpointer
    from gpufleet.train.exactddp import DDPWatcher

__all__ = ["ABANDON_WAIT_S", "HeldRestore", "Recovery", "read_order"]

# How long an abandoned round's checkpoint engine may take to notice its dead peer and stop.
ABANDON_WAIT_S = 5.0

# Puts a loaded state dict (of commit ``step``, with its meta) into the objects; returns its skip windows.
Apply = Callable[[dict[str, Any], int, dict[str, Any]], list[list[int]]]


def read_order() -> dict[str, Any]:
    """The supervisor's next order on stdin (a survivor's or a spare's; train/inprocess.py), applied to
    the environment. EOF or ``{"exit": true}``: the supervisor chose otherwise, and this process leaves
    quietly. ``{"rebuild": true}``: raises :class:`RebuildRound`."""
    line = sys.stdin.readline()
    order = json.loads(line) if line else {"exit": True}
    if order.get("exit"):
        sys.stdout.flush()
        os._exit(ExitCode.FAILED if line else ExitCode.OK)
    os.environ.update(order["env"])
    os.environ[Env.SPAWN_T] = str(time.time())
    if order.get("rebuild"):
        raise RebuildRound("the new round's ranks build their objects: running the script again")
    return order


@dataclass(frozen=True, slots=True)
class HeldRestore:
    """What an in-place restore took from the rank's own memory."""

    step: int
    path: str
    source: E.RestoreSource  # process: a survivor's snapshot; else where the spare's preload read it
    skips: list[list[int]]  # the skip windows saved with the commit


class Recovery:
    """One rank's in-process recovery state. ``spare``: the rank a hot spare built for (None: a rank
    of a round); ``in_place``: a peer's death is survived at the step boundary."""

    def __init__(self, *, spare: int | None, in_place: bool) -> None:
        self.spare = spare
        self.in_place = in_place
        self.errored: str | None = None  # a collective failed this round (the step is discarded)
        self.held: Held | None = None  # a promoted spare's preload, until the restore uses it
        self._reader: CheckpointEngine | None = None  # a waiting spare's reader of commits
        self._preload_refused = False  # a spare whose node cannot hold its preloads (preload_reader)
        self._emptied: list[tuple[dict[str, Any], list[torch.Tensor]]] = []  # set aside by a discarded step

    # ------------------------------------------------------------------ failures of the round
    def survivable(self, exc: BaseException, ddp: DDPWatcher | None) -> bool:
        """Whether this error is a dead peer's that the step boundary can absorb. Not with a DDP the run
        cannot move to a new group (one with the script's own communication hook): its error escapes
        the step, and the in-process harness takes over (it runs the script again)."""
        if not self.in_place or (ddp is not None and ddp.foreign):
            return False
        return survivable(exc)

    def note_error(self, exc: BaseException) -> None:
        if self.errored is None:
            first = str(exc).splitlines()[0][:300] if str(exc) else ""
            self.errored = f"{type(exc).__name__}: {first}"

    def round_error(self, ddp: DDPWatcher | None) -> str | None:
        """This round's collective failure, from the run's own collectives or DDP's (the hook)."""
        if self.errored is None and ddp is not None:
            exc = ddp.errored()
            if exc is not None:
                self.note_error(exc)
        return self.errored

    # ------------------------------------------------------------------ a discarded step's update
    def set_aside(self, optimizer: torch.optim.Optimizer) -> None:
        """A discarded step (a peer died in its all-reduce): its update would be rolled back, so the
        optimizer steps over no parameters instead; the recovery starts that much sooner (an AdamW
        step is a third of P3's step). :meth:`put_back` returns the lists right after the step."""
        self._emptied.extend((group, group["params"]) for group in optimizer.param_groups)
        for group in optimizer.param_groups:
            group["params"] = []

    def put_back(self) -> None:
        for group, params in self._emptied:
            group["params"] = params
        self._emptied.clear()

    # ------------------------------------------------------------------ a hot spare
    def await_promotion(
        self, settings: RunSettings, preload: Callable[[int], Held | None]
    ) -> Preloader | None:
        """A hot spare: wait for the order that makes it a rank, then leave the placeholder group. Its
        model and optimizer were built meanwhile. In place, ``preload(step)`` loads each new commit into
        them while it waits; the returned preloader has what they hold (see :meth:`promoted`)."""
        # What the restore imports on first use (the checkpoint engine, DCP's readers: 40 ms measured
        # on the promoted spare's critical path), imported while there is nothing else to do.
        import gpufleet.checkpoint.engine  # noqa: F401
        import gpufleet.reliability.interval  # noqa: F401
        import gpufleet.train.exactddp  # noqa: F401

        ready = Env.SPARE_READY.get()
        os.environ.pop(Env.SPARE_READY, None)  # a rank this spare becomes must not see it
        if ready:  # built: the backend may now promote it as it is (a spare still building is not hot)
            with open(ready, "w"):
                pass
        preloader = None
        if self.in_place:  # each new commit loaded into the objects while it waits (train/held.py)
            preloader = Preloader(settings.ckpt_dir, settings.rollback.max_step, preload)
            preloader.start()
        try:
            read_order()
        finally:
            if preloader is not None:
                preloader.stop()
        rank = Platform.RANK.get()
        if rank != self.spare:
            raise RebuildRound(f"a spare built for rank {self.spare} was promoted to rank {rank}")
        self.spare = None
        dist.destroy_process_group()
        return preloader

    def promoted(self, preloader: Preloader | None, max_step: int | None, checkpointer: Checkpointer) -> None:
        """A spare that is a rank of its round now: one more look for a commit to hold, and its reader's
        staging buffers serve the saves."""
        if preloader is None:
            return
        self.held = preloader.catch_up(max_step)
        checkpointer.carry, self._reader = self._reader, None

    def preload_reader(self, settings: RunSettings, world_size: int, step: int) -> CheckpointEngine | None:
        """A waiting spare's reader of commits (it has no group yet), made by the first preload; None
        when the node cannot hold a preload (:meth:`_preload_fits`)."""
        if self._reader is None:  # the first preload allocates what the spare holds from then on
            if not self._preload_fits(settings, world_size, step):
                return None
            from gpufleet.checkpoint import CheckpointConfig, CheckpointEngine

            cfg = CheckpointConfig(dir=str(settings.ckpt_dir), read_only=True)
            self._reader = CheckpointEngine(cfg, rank=0, world_size=1)
        return self._reader

    def _preload_fits(self, settings: RunSettings, world_size: int, step: int) -> bool:
        """Whether this node's spares (one per local rank) can each hold a commit's state ahead of
        their promotion: half the available memory at most, as for a snapshot. Decided once: a spare
        refused holds nothing and loads as usual once promoted (one warning)."""
        from gpufleet.checkpoint.staging import available_memory, local_ranks, within_half
        from gpufleet.train.held import commit_bytes

        if self._preload_refused:
            return False
        size, avail = commit_bytes(settings.ckpt_dir, step), available_memory()
        ranks = local_ranks(world_size)
        if size is None or within_half(size, ranks, avail):
            return True
        self._preload_refused = True
        print(
            f"gpufleet: warning: hot spare: no preload of step {step}: {ranks} spares on this node "
            f"would hold {size / 2**20:.0f} MiB each, {(avail or 0) / 2**20:.0f} MiB is available; "
            "it loads once promoted",
            file=sys.stderr,
            flush=True,
        )
        return False

    # ------------------------------------------------------------------ a round rejoined in place
    def leave_round(self, checkpointer: Checkpointer, sink: EventSink) -> None:
        """A peer died during this step: leave the broken round without a collective (the save in
        flight stops, the groups go, the objects lose this step's gradients), say so, and wait for the
        next round's order. The caller then joins it and rolls the objects back."""
        t0 = time.monotonic()
        reason = self.errored or "collective failed"
        checkpointer.leave_round(ABANDON_WAIT_S)  # a save that needed the dead peer stops
        try:
            dist.destroy_process_group()  # the default group and every group made from it
        except Exception:  # noqa: BLE001 - a half-dead group may fail to tear down; the new round makes its own
            pass
        assert checkpointer.mapper is not None
        self.put_back()  # had the optimizer step raised, they would still be set aside
        checkpointer.mapper.drop_gradients()  # as a fresh rank has them: none
        sink.emit(E.Rejoin(reason=reason[:300], abort_s=round(time.monotonic() - t0, 6), in_place=True))
        read_order()
        self.errored = None

    def restore_held(
        self,
        checkpointer: Checkpointer,
        *,
        max_step: int | None,
        group: ProcessGroup | None,
        sink: EventSink,
        apply: Apply,
    ) -> HeldRestore | None:
        """In place: restore from what every rank of the round already holds (train/held.py), when all
        hold the newest commit: a survivor its engine's snapshot, a promoted spare its preload. None:
        the round loads from storage. A collective: every rank of the round calls it."""
        from gpufleet.checkpoint.snapshot import SnapshotMismatch
        from gpufleet.train.held import agree, newest_commit

        held, self.held = self.held, None
        snap = checkpointer.snapshot(max_step)
        step: int | None = None
        template: dict[str, Any] | None = None
        if snap is not None:
            t_verify = time.monotonic()
            reason = snap.verify()
            if reason is None and checkpointer.is_main:
                sink.emit(
                    E.CkptVerified(
                        step=snap.step,
                        path=snap.path,
                        verify_s=round(time.monotonic() - t_verify, 6),
                        source=E.RestoreSource.PROCESS,
                    )
                )
            if reason is None:
                template = checkpointer.state_dict()
                try:
                    snap.check(template)
                    step = snap.step
                except SnapshotMismatch as e:
                    reason, template = str(e), None
            if reason is not None:
                sink.emit(
                    E.RestoreRejected(path=snap.path, step=snap.step, reason=f"in-process copy: {reason}")
                )
        elif held is not None and (max_step is None or held.step <= max_step):
            step = held.step
        if not agree(step, newest_commit(checkpointer.settings.ckpt_dir, max_step), group):
            return None
        assert step is not None
        if template is not None and snap is not None:
            snap.copy_into(template)
            return HeldRestore(step, snap.path, E.RestoreSource.PROCESS, apply(template, step, snap.meta))
        assert held is not None
        return HeldRestore(step, held.path, E.RestoreSource(held.source), held.skips)

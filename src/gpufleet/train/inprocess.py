"""In-process restart, the worker's side (``gpufleet run --in-process-restart``).

A surviving rank does not exit when a peer dies. The failure reaches it as an error from a
collective (gloo: "Connection closed by peer"; NCCL: a communicator error), raised somewhere in the
user's script: DDP's backward, ``run.log``'s control all-reduce, a checkpoint collective. The
script's stack unwinds; this harness, which ran the script with :mod:`runpy`, catches the error at
the top, and

1. **aborts**: the previous round's :class:`~gpufleet.train.run.Run` is abandoned (its checkpoint
   engine given a bounded wait, no collective), every process group is destroyed, and the round's
   objects (model, optimizer, loader and its worker processes) are released;
2. **says so** on the control pipe (a ``rejoin`` event, with the error and the abort time);
3. **waits for its order**: one JSON line on stdin from the supervisor, the same order a standby
   interpreter receives (the new round's environment: a new rendezvous port, the attempt, the fault
   plan), or ``{"exit": true}`` when the supervisor chose a full restart after all;
4. **runs the script again**, in the same process (this harness is the fallback: where it can, the run
   API survives the failure in place, without unwinding the script; see "In place" below): the
   interpreter, every imported module (torch),
   thread pools and, on a GPU, the CUDA context are kept; ``gpufleet.init()`` forms the new process
   group with the replacement rank, and ``run.restore`` rolls back to the newest checkpoint, from the
   in-memory tier first (``--memory-tier``), exactly as a restarted process would, so the run stays
   bit-identical.

Only an error from a collective is survivable this way. Anything else (a bug in the script, a CUDA
error, an out-of-memory) leaves the process as before, and the supervisor falls back to a full
restart. So does a second failure at the same step (the supervisor's rule).

**In place** (the usual path): with the harness's ``GPUFLEET_IN_PROCESS=1``, a DDP model's gradient
all-reduce (exactddp's hook) and the run API's own collectives do not raise on a dead peer. The step
runs to its end, and at its boundary :class:`~gpufleet.train.run.Run` discards it: it leaves the round
(the same abort, the same ``rejoin`` event with ``in_place``), reads its order itself, re-forms the
group, moves DDP to it and rolls the *same* model and optimizer back to the newest checkpoint. Nothing
is rebuilt or freed. The replacement is a **hot spare**: a standby that already ran the script up to
``run.restore`` for the lost rank (a placeholder group stood in for the world), so it only joins the
round and loads the state.

The harness runs the script as ``__main__`` like the standby does (it *is* the standby's main loop
when the order says ``"in_process": true``); the first attempt's ranks are started through it too.
"""

from __future__ import annotations

import gc
import json
import os
import runpy
import sys
import time
from typing import IO, Any

from gpufleet.core.env import Env, Platform
from gpufleet.core.exitcodes import ExitCode
from gpufleet.train.peerloss import survivable

__all__ = ["serve", "survivable"]


def _run_script(argv: list[str], module: bool) -> None:
    sys.argv = list(argv)
    if module:
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(argv[0], run_name="__main__")


def _abort() -> None:
    """Leave the failed round: abandon its Run, destroy every process group, free its objects."""
    from gpufleet.train import run as run_mod
    from gpufleet.train.recovery import ABANDON_WAIT_S

    run_mod.abandon_current(wait_s=ABANDON_WAIT_S)
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()  # the default group and every group made from it
    except Exception:  # noqa: BLE001 - a half-dead group may fail to tear down; the new round makes its own
        pass
    # The script's frames are gone: this frees its model, optimizer and loader workers (their cycles)
    # before the next round allocates its own. It runs while the replacement rank starts up, which the
    # new rendezvous waits for anyway.
    gc.collect()


def _rejoin(reason: str, abort_s: float) -> None:
    """Tell the supervisor (the ``rejoin`` event, on the control pipe every rank inherits)."""
    from gpufleet.core import events as E
    from gpufleet.core.ledger import PipeSink

    fd = Env.CONTROL_FD.get()
    if fd is None:
        return
    rank = Platform.RANK.get()
    try:
        PipeSink(fd, rank).emit(E.Rejoin(reason=reason[:300], abort_s=round(abort_s, 6)))
    except (OSError, ValueError):
        pass  # no usable channel: the supervisor still sees the failure and orders us


def serve(order: dict[str, Any], orders: IO[str], apply: Any) -> None:
    """Run rounds of the script as ordered until one ends without a survivable failure.

    ``order``: the first round's order (already read); ``orders``: where the next ones arrive;
    ``apply(order)``: sets the round's environment (the standby's own order handling).
    """
    argv: list[str] = order["argv"]
    module = bool(order.get("module"))
    # The run API survives a peer's death in place where it can (train/run.py: the step is discarded
    # at its boundary, the objects are rolled back); what escapes the script comes here.
    os.environ[Env.IN_PROCESS] = "1"
    while True:
        try:
            _run_script(argv, module)
            return  # the script ended normally: the process exits 0 (or the script's own code)
        except BaseException as exc:
            from gpufleet.core.errors import RebuildRound

            if isinstance(exc, RebuildRound):  # its round's other ranks build: so must this one
                del exc
                _abort()
                continue  # its order is applied: run the script again
            if not survivable(exc):
                raise
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
            exc.__traceback__ = None  # the frames hold the round's objects
            del exc
        t0 = time.monotonic()
        _abort()
        _rejoin(reason, time.monotonic() - t0)
        line = orders.readline()
        if not line:  # the supervisor went away or closed us: nothing to rejoin
            sys.stdout.flush()
            os._exit(ExitCode.FAILED)
        order = json.loads(line)
        if order.get("exit"):
            sys.stdout.flush()
            os._exit(ExitCode.FAILED)
        apply(order)

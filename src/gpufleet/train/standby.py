"""A standby worker: an interpreter that has already imported torch and waits to become a rank.

Forked ahead of time by the run's warm interpreter (train/zygote.py), which imported torch and the rest
of ``IMPORTS`` once for all of them. On a restart the supervisor writes one JSON line to its stdin
({"env": {...}, "argv": [...], "module": bool, "threads": N|null, "cpus": [...]|null}); the standby
applies it and runs the training script as ``__main__``. This removes interpreter start-up and ``import
torch`` from MTTR. :func:`main` also runs in an interpreter of its own (``python -m
gpufleet.train.standby``): it then imports ``IMPORTS`` itself, as described below.

**It must not slow the running workers down.** The imports (seconds of CPU) run in a helper thread
that first puts *itself* in ``SCHED_IDLE``: it gets a CPU only when no normal thread wants one. On
Linux the scheduling policy is per thread, and lowering one's own is allowed unprivileged. The main
thread never changes its policy, so the promoted rank, and every thread it starts (OpenMP, gloo,
checkpoint I/O), runs at normal priority. That is the point of doing it in a thread: an unprivileged
process cannot raise a lowered priority back (leaving ``SCHED_IDLE`` or lowering a nice value needs
``CAP_SYS_NICE`` or an ``RLIMIT_NICE`` few set), so ``nice`` or ``SCHED_IDLE`` on the whole standby
would leave the promoted rank slow for the rest of the run. A native thread that the imports started
(``import torch`` starts one) inherits ``SCHED_IDLE``; on promotion the standby returns those to
normal where it may (as root), and otherwise leaves them: they do no work in training.

An eager standby (``GPUFLEET_STANDBY_EAGER=1``) imports at normal priority: the first attempt's, made
once it has committed its first checkpoint, so that they are ready within seconds; one made just
before an attempt starts, which is promoted at once; and in-process restart's ranks and first hot
spares, which start beside the first workers. Even at idle priority, two standbys' imports slowed a
dozen steps of two CPU-bound workers on 2 cores by 40 ms each (cache and memory traffic, and the
wake-up of a rank that waits in an all-reduce); at normal priority they are 13-14 CPU seconds, which
is why the first attempt's standbys wait for its first checkpoint: a short job never pays them.

**On a GPU host it also makes its GPU's CUDA context before promotion.** The backend starts each
standby for one slot (``GPUFLEET_STANDBY_GPU``: the local rank it will become; its
``CUDA_VISIBLE_DEVICES`` when the slot plan sets one). Once the imports are done, unless its order has
come first, the main thread makes that GPU's context, loads cuBLAS with a small matmul and warms the
caching allocator: on an H200, making the context and moving the model after promotion were 88% of a
3.0 s MTTR. The main thread, because it keeps normal priority: the CUDA driver's own threads, started
with the context, inherit the priority of the thread that makes it, and must not stay idle for the
rest of the run. Its current device is left as it was (torch does not switch back to a device that
has no context, so none is made on GPU 0): the script starts on the default device, as in a fresh
process, and its ``torch.cuda.set_device(LOCAL_RANK)`` and ``model.to(device)`` find the context made.
Where ``torch.cuda.is_available()`` is False it does nothing. ``GPUFLEET_STANDBY_CUDA=0`` turns it off.
"""

from __future__ import annotations

import gc
import json
import os
import runpy
import select
import sys
import threading
import time

from gpufleet.core.env import Env
from gpufleet.train.priority import restore_threads, set_idle

__all__ = ["main", "IMPORTS", "cuda_context", "set_idle", "restore_threads"]

# What a restarted rank would otherwise import on its critical path. DDP's constructor imports
# torch._dynamo (about 200 modules: 0.5 s of a 0.6 s recovery at 5 MB of state on the CI host).
IMPORTS = (
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.nn.parallel",
    "torch._dynamo",
    "gpufleet.train.run",
)


def _warm(idle: bool) -> None:
    if idle:
        set_idle()
    for mod in IMPORTS:  # the point: pay for these before a failure, not after
        __import__(mod)


def cuda_context(local_rank: int) -> str | None:
    """Make the CUDA context of ``local_rank``'s GPU (``local_rank % device_count``, the device
    ``gpufleet.init()`` gives that rank), leaving the current device as it was; the device, or None on
    a host without CUDA. Best effort: a failure is one line on stderr, and the rank makes it itself."""
    import torch

    if not torch.cuda.is_available():
        return None
    try:
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        with torch.cuda.device(device):  # back to the previous device on exit, if it has a context
            x = torch.ones(64, 64, device=device)
            (x @ x).sum().item()  # the context, cuBLAS and the caching allocator's first block
        return str(device)
    except Exception as e:  # noqa: BLE001 - the promoted rank makes its context itself, as a fresh one does
        print(
            f"gpufleet: standby: no CUDA context made ahead on local rank {local_rank}: {e}", file=sys.stderr
        )
        return None


def _idle_until_imported(warm: threading.Thread) -> bool:
    """Wait for the imports; False when the order came first (a hot spare's at once, or a failure
    while this standby still imports): the rank then makes its context itself, as a fresh one does."""
    while warm.is_alive():
        if select.select([0], [], [], 0.05)[0]:  # an order, or EOF: read it now
            return False
    return True


def _set_cpus(cpus: list[int]) -> None:
    """Affinity for every thread of this process (affinity is per thread; new threads inherit it)."""
    for name in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(name), cpus)
        except OSError:
            pass  # a thread that just ended


def main() -> None:
    # Eager: needed within seconds (see the module's docstring), not trickling in at idle priority.
    idle = os.environ.pop(Env.STANDBY_EAGER, "") != "1"
    gpu = Env.STANDBY_GPU.get()
    os.environ.pop(Env.STANDBY_GPU, None)  # the rank this standby becomes must not see it
    warm = threading.Thread(target=_warm, args=(idle,), name="gpufleet-standby-warm", daemon=True)
    warm.start()
    if gpu is not None and _idle_until_imported(warm):
        cuda_context(gpu)  # an order that comes meanwhile waits for it: the rank would make it anyway
    line = sys.stdin.readline()
    if not line:  # the supervisor closed us: not needed
        return
    order = json.loads(line)
    in_process = bool(order.get("in_process"))
    if not in_process:  # one order only: stdin is done with
        sys.stdin.close()
        os.close(0)
        os.open(os.devnull, os.O_RDONLY)  # fd 0 again, so nothing else lands there
    _apply(order)
    restore_threads()  # where permitted, an import still running finishes at normal priority
    warm.join()
    # The imports left some 300,000 objects (torch, torch._dynamo) that live as long as the process: out
    # of the collector's sight, a full collection (the in-process harness's abort, or one triggered by
    # the script's allocations) scans only what the script made: 0.2-0.3 s less on 2 loaded cores.
    gc.freeze()
    restore_threads()
    if order.get("cpus"):
        _set_cpus(order["cpus"])
    if order.get("threads"):
        import torch

        torch.set_num_threads(int(order["threads"]))  # OpenMP read its variable at spawn: may differ
    if order.get("log"):  # the supervisor's live view owns the terminal: write to the rank's log file
        fd = os.open(order["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    argv: list[str] = order["argv"]
    if not order.get("module"):
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    if in_process:  # survive a peer's death in this process: the harness runs the script in rounds
        from gpufleet.train.inprocess import serve

        serve(order, sys.stdin, _apply)
        return
    sys.argv = list(argv)
    if order.get("module"):
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(argv[0], run_name="__main__")


def _apply(order: dict[str, object]) -> None:
    """A round's environment (the rank, the rendezvous, the attempt), and when it was handed over."""
    env = order["env"]
    assert isinstance(env, dict)
    os.environ.update(env)
    os.environ[Env.SPAWN_T] = str(time.time())


if __name__ == "__main__":
    main()

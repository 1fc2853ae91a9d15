"""Run ranks as child processes of this host's supervisor, optionally from pre-spawned standbys.

Each rank gets its share of the host's CPUs as its thread count, and optionally its own CPUs
(:mod:`gpufleet.backends.resources`). A rank's CPUs are set without ``preexec_fn`` (unsafe in a
process with threads) and without an extra interpreter: affinity is per thread on Linux and a child
inherits the mask of the thread that forks it, so the spawning thread narrows its own mask around
``Popen`` and widens it again. A standby interpreter, started before its rank was known, sets the
CPUs of all its threads itself when it is promoted.

With ``min_nproc`` below the ranks asked for, a worker slot (a local rank; its GPU where there are
GPUs) that fails ``slot_failures`` times in a row is dropped and the run continues on the others, down
to ``min_nproc``: the world size shrinks, as the srun backend's does when it loses a node.

Every standby belongs to a slot from its start, and is promoted only to that slot's local rank: it is
started with the slot's ``CUDA_VISIBLE_DEVICES`` (once a slot was dropped) and, unless
``GPUFLEET_STANDBY_CUDA=0``, told its local rank (``GPUFLEET_STANDBY_GPU``), so on a GPU host it makes
that GPU's CUDA context before promotion (train/standby.py) and the rank's own ``.to(device)`` finds
it made.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from gpufleet.backends.base import CONTINUE, Attempt, Backend, Blame, LaunchSpec, RejoinWait, Verdict, Worker
from gpufleet.backends.process import ProcessAttempt, send_signal
from gpufleet.backends.resources import RankResources, host_plan, parse_cpu_affinity, thread_env, thread_note
from gpufleet.backends.zygote import ForkedProcess, Zygote
from gpufleet.core import events as E
from gpufleet.core.env import Env, Platform
from gpufleet.core.errors import ConfigError
from gpufleet.core.ledger import EventSink

__all__ = ["LocalBackend", "python_entry", "visible_devices"]


def python_entry(command: list[str]) -> tuple[list[str], bool] | None:
    """(argv, is_module) when ``command`` is ``python SCRIPT ...`` or ``python -m MOD ...``; else None.

    Only those shapes can be handed to a standby interpreter; anything else is spawned fresh.
    """
    if not command or not os.path.basename(command[0]).startswith("python"):
        return None
    rest = command[1:]
    if len(rest) >= 2 and rest[0] == "-m":
        return [rest[1], *rest[2:]], True
    if rest and not rest[0].startswith("-") and rest[0].endswith(".py"):
        return rest, False
    return None


# How long a failure waits for the lost rank's spare to finish building before the round rebuilds.
_SPARE_BUILD_WAIT_S = 120.0


@dataclass
class _Standby:
    proc: ForkedProcess
    read_fd: int
    write_fd: int
    # A hot spare (in-process restart): the rank and world size it runs the script for, up to
    # run.restore, before any failure; None: a plain standby, which waits with torch imported.
    rank: int | None = None
    world: int | None = None
    ready_path: str | None = None  # the spare creates it once built, waiting in run.restore
    slot: int = 0  # the local rank it was started for: its CPU share and GPU
    gpu: bool = False  # it makes its slot's CUDA context before promotion: only that local rank may take it

    def hot(self) -> bool:
        """A spare that finished building and still waits for its promotion."""
        return self.ready_path is not None and os.path.exists(self.ready_path) and self.proc.poll() is None


class LocalBackend(Backend):
    """Ranks are child processes of this process: fresh, or standby interpreters made ready earlier."""

    name = "local"

    def __init__(
        self,
        standby: bool = True,
        python: str | None = None,
        min_nproc: int | None = None,
        slot_failures: int = 2,
        in_process: bool = False,
        host_store: bool = True,
    ) -> None:
        if min_nproc is not None and min_nproc < 1:
            raise ConfigError(f"--min-nproc must be >= 1, got {min_nproc}")
        if slot_failures < 1:
            raise ConfigError(f"--slot-failures must be >= 1, got {slot_failures}")
        self.standby = standby
        self.python = python or sys.executable
        self.min_nproc = min_nproc
        self.slot_failures = slot_failures
        self.in_process = in_process  # ranks run under the in-process restart harness (train/inprocess.py)
        # The attempt's rendezvous store is hosted by the supervisor's side (the zygote's store host), as
        # torchrun's agent hosts it, not by rank 0: a rank that reaches init_process_group before rank 0
        # has started the server backs off and retries, 0.13-0.5 s of MTTR whenever a warm replacement
        # comes up before the rank that hosts the store. Off where
        # this backend starts one node's ranks of a multi-node job (the agent).
        self.host_store = host_store
        self._warm: Zygote | None = None  # the warm interpreter: standbys and stores (backends/zygote.py)
        self.slots: list[int] | None = None  # worker slots in use (local ranks of the first attempt)
        self.dropped: list[int] = []
        self._strikes: tuple[int, int] | None = None  # (slot, consecutive failures blamed on it)
        self._standbys: list[_Standby] = []
        self._spare_dir: str | None = None  # where hot spares say they are built
        self._plans: dict[tuple[int, str], list[RankResources]] = {}
        self._noted = False
        self._warm_gpu: bool | None = None  # GPUFLEET_STANDBY_CUDA, as the ranks get it (read once)
        Env.STANDBY_CUDA.get()  # a bad value in the launching environment stops the run before it starts

    @classmethod
    def options(cls, flags: Mapping[str, Any]) -> dict[str, Any]:
        """None of its own; a bad ``GPUFLEET_STANDBY_CUDA`` (the shell's, ``--env``, ``--env-file``)
        stops ``gpufleet run`` here, before it writes or launches anything."""
        from gpufleet.backends.environ import parse_env_file, parse_env_items

        env = parse_env_file(flags["env_file"]) if flags.get("env_file") else {}
        env.update(parse_env_items(flags.get("env") or ()))
        Env.STANDBY_CUDA.get({**os.environ, **env})
        return {}

    # -- hooks ---------------------------------------------------------------------------------
    def prepare(self, spec: LaunchSpec, *, eager: bool = False) -> None:
        if not self.standby or not self.forkable(spec):
            return
        slots = self.active_slots(spec)
        plan = self._plan(spec, len(slots))
        if self.in_process:  # a hot spare per rank that has none: the one that replaces it
            spec.nproc_per_node = len(slots)
            have = {(sb.rank, sb.world) for sb in self._standbys if sb.proc.poll() is None}
            for local_rank in range(len(slots)):
                if (spec.place(local_rank).rank, spec.world_size) not in have:
                    self._standbys.append(self._spawn_spare(spec, local_rank, eager=eager))
            return
        have = {sb.slot for sb in self._standbys if sb.rank is None and sb.proc.poll() is None}
        for local_rank in range(len(slots)):  # one waiting per slot: it warms that slot's GPU
            if local_rank not in have:
                self._standbys.append(self._spawn_standby(spec, plan[local_rank], local_rank, eager=eager))

    def _spawn_spare(self, spec: LaunchSpec, local_rank: int, *, eager: bool) -> _Standby:
        """A standby ordered at once to run the script as a hot spare for this rank: it builds what the
        script builds before ``run.restore`` (on a placeholder group) and waits there for its promotion
        order, which carries the round's environment (train/run.py, ``_promote``)."""
        res = self._plan(spec, spec.nproc_per_node)[local_rank]
        sb = self._spawn_standby(spec, res, local_rank, eager=eager)
        env, threads = self._rank_env(spec, local_rank)
        rank = spec.place(local_rank).rank
        if self._spare_dir is None:
            self._spare_dir = tempfile.mkdtemp(prefix="gpufleet-spares-")
        sb.ready_path = os.path.join(self._spare_dir, f"{sb.proc.fork_id}.ready")
        env[Env.SPARE] = str(rank)
        env[Env.SPARE_READY] = sb.ready_path
        self._order(sb, spec, env, res, threads, rank)
        sb.rank, sb.world = rank, spec.world_size
        return sb

    def _order(
        self,
        sb: _Standby,
        spec: LaunchSpec,
        env: dict[str, str],
        res: RankResources,
        threads: bool,
        rank: int,
    ) -> None:
        """A standby's first order: what to run, as which rank, where its output goes."""
        entry = python_entry(spec.command)
        assert entry is not None and sb.proc.stdin is not None
        argv, is_module = entry
        order = {
            "env": env,  # its event pipe (GPUFLEET_CONTROL_FD) it has had since the fork
            "argv": argv,
            "module": is_module,
            "log": _prepare_log(spec.log_path(rank)),
            "threads": res.threads if threads else None,
            "cpus": sorted(res.cpus) if res.cpus is not None else None,
            "in_process": self.in_process,
        }
        sb.proc.stdin.write((json.dumps(order) + "\n").encode())
        sb.proc.stdin.flush()

    def standby_env(self, spec: LaunchSpec, local_rank: int) -> dict[str, str]:
        """What a standby started for ``local_rank`` knows of its slot before promotion: the slot's
        ``CUDA_VISIBLE_DEVICES`` (as its rank gets it: fixed when CUDA starts, so it cannot wait for the
        order), and the local rank whose GPU it warms unless ``GPUFLEET_STANDBY_CUDA=0``."""
        env: dict[str, str] = visible_devices(self.active_slots(spec)) if self.dropped else {}
        if self._standby_cuda(spec):
            env[Env.STANDBY_GPU] = Env.STANDBY_GPU.format(local_rank)
        return env

    def _standby_cuda(self, spec: LaunchSpec) -> bool:
        """``GPUFLEET_STANDBY_CUDA`` where the ranks read it (the launch, ``--env``); the first attempt's
        start reads it, before it launches anything, so a bad value stops the run there."""
        if self._warm_gpu is None:
            self._warm_gpu = Env.STANDBY_CUDA.get({**os.environ, **spec.forward, **spec.env})
        return self._warm_gpu

    def _spawn_standby(
        self, spec: LaunchSpec, res: RankResources, local_rank: int, *, eager: bool
    ) -> _Standby:
        r, w = os.pipe()
        slot_env = self.standby_env(spec, local_rank)
        env = {**os.environ, **spec.forward, **spec.env, **slot_env}
        # The share is fixed before `import torch`: OpenMP reads it once, as the library loads.
        env.update(thread_env(res.threads, env), **{Env.CONTROL_FD: str(w)})
        if eager:  # warm at normal priority: see Backend.prepare
            env[Env.STANDBY_EAGER] = Env.STANDBY_EAGER.format(True)
        proc = self._zygote(spec).fork(env, w, eager=eager)
        return _Standby(proc, r, w, slot=local_rank, gpu=Env.STANDBY_GPU in slot_env)

    def forkable(self, spec: LaunchSpec) -> bool:
        """Whether the warm interpreter can run this command: ``python SCRIPT`` or ``python -m MOD``
        with an interpreter of this environment (the same ``bin`` directory as the one gpufleet runs
        in, so the same site-packages). Another environment's python runs as a fresh process."""
        if python_entry(spec.command) is None:
            return False
        found = shutil.which(spec.command[0])
        return found is not None and os.path.dirname(os.path.abspath(found)) == os.path.dirname(
            os.path.abspath(self.python)
        )

    def _zygote(self, spec: LaunchSpec) -> Zygote:
        """The warm interpreter that forks this run's standbys and hosts its stores (train/zygote.py),
        started with the environment the ranks get, so what torch reads as it loads is theirs."""
        if self._warm is None or not self._warm.alive():
            if self._warm is not None:
                self._warm.close()
            env = {**os.environ, **spec.forward, **spec.env}
            env.update(thread_env(self._plan(spec, len(self.active_slots(spec)))[0].threads, env))
            self._warm = Zygote(self.python, env, store=self.host_store)
        return self._warm

    def start(self, spec: LaunchSpec) -> ProcessAttempt:
        self._standby_cuda(spec)
        slots = self.active_slots(spec)
        spec.nproc_per_node = len(slots)  # fewer after a slot was dropped: the world size shrinks
        # Hot spares join as they are only when every rank of the round is one; else they build again.
        ranks = [spec.place(i).rank for i in range(spec.nproc_per_node)]
        rebuild = not all(self._spare_for(r, spec.world_size) for r in ranks)
        launched = [self._launch(spec, i, rebuild=rebuild) for i in range(spec.nproc_per_node)]
        if self.host_store:  # after the spawns: the ranks import torch meanwhile, and retry until it is up
            self._zygote(spec).open_store(spec.master_addr, spec.master_port, spec.world_size)
        return _attempt(spec, launched)

    def replace(
        self,
        attempt: Attempt,
        lost: Collection[int],
        spec: LaunchSpec,
        rejoined: RejoinWait | None = None,
    ) -> ProcessAttempt | None:
        """In-process restart: kill the ``lost`` ranks, order the survivors (started through the
        in-process harness) into the new round, and promote standbys for the lost ranks.

        None when it cannot be done here (in-process restart off, a command a standby cannot run, the
        world size changed, a survivor is gone too): the supervisor then restarts the whole attempt.
        """
        if not self.in_process or not self.forkable(spec):
            return None
        if not isinstance(attempt, ProcessAttempt):
            return None
        slots = self.active_slots(spec)
        if len(slots) != len(attempt.workers) or not attempt.orders:
            return None
        spec.nproc_per_node = len(slots)
        survivors = [w.rank for w in attempt.workers if w.rank not in lost]
        codes = attempt.poll()
        if any(codes[r] is not None for r in survivors) or any(r not in attempt.orders for r in survivors):
            return None
        attempt.kill(lost)
        # Survivors that kept their objects and hot spares form a round together; a survivor that runs
        # its script again builds (DDP's constructor is a collective), and so must every other rank.
        in_place = rejoined(survivors) if rejoined is not None else False
        if in_place is None:
            return None  # a survivor did not leave its round: the supervisor restarts the whole attempt
        rebuild = not in_place or not all(self._spare_for(r, spec.world_size) for r in lost)
        if self.host_store:  # up before any rank of the new round asks for it
            self._zygote(spec).open_store(spec.master_addr, spec.master_port, spec.world_size)
        kept = attempt.handover(survivors)
        launched: list[_Launched] = []
        for local_rank in range(spec.nproc_per_node):
            rank = spec.place(local_rank).rank
            if rank in kept:
                worker, proc, fd, orders = kept[rank]
                env, _ = self._rank_env(spec, local_rank)
                orders.write((json.dumps({"env": env, "rebuild": rebuild}) + "\n").encode())
                orders.flush()
                launched.append((worker, proc, fd, orders))
            else:
                launched.append(self._launch(spec, local_rank, rebuild=rebuild))
        return _attempt(spec, launched)

    def _spare_for(self, rank: int, world: int) -> bool:
        """Whether this rank has a hot spare. One still building is waited for (a rebuild would build
        the same things from further back); one whose build failed, or that outlasts the wait, is not."""
        mine = [sb for sb in self._standbys if (sb.rank, sb.world) == (rank, world)]
        live = [sb for sb in mine if sb.proc.poll() is None]
        if not live:
            return False
        deadline = time.monotonic() + _SPARE_BUILD_WAIT_S
        while not live[0].hot():
            if live[0].proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def _rank_env(self, spec: LaunchSpec, local_rank: int) -> tuple[dict[str, str], bool]:
        """A rank's environment for ``spec``, and whether the thread variables were set by gpufleet."""
        res = self._plan(spec, spec.nproc_per_node)[local_rank]
        devices = visible_devices(self.active_slots(spec)) if self.dropped else {}
        env = {**spec.forward, **spec.env, **spec.rank_env(local_rank), **devices}
        if self.host_store:  # torch's env:// rendezvous: every rank a client of this process's store
            env[AGENT_STORE_ENV] = "True"
        threads = thread_env(res.threads, {**os.environ, **env})
        env.update(threads)
        return env, bool(threads)

    def _launch(self, spec: LaunchSpec, local_rank: int, *, rebuild: bool = False) -> _Launched:
        """Start one rank: a standby promoted, or a fresh process (for a command a standby cannot run)."""
        res = self._plan(spec, spec.nproc_per_node)[local_rank]
        env, threads = self._rank_env(spec, local_rank)
        rank = spec.place(local_rank).rank
        entry = python_entry(spec.command) if self.forkable(spec) else None
        sb = self._take_standby(rank, spec.world_size, local_rank) if entry is not None else None
        if sb is None and entry is not None and (self.in_process or self.standby):
            # A fork of the warm interpreter, promoted at once: one import of torch for all the ranks
            # (and under in-process restart, every rank runs under its harness, the first attempt's too).
            sb = self._spawn_standby(spec, res, local_rank, eager=True)
        if sb is not None and entry is not None and sb.proc.stdin is not None:
            if sb.rank is None:
                self._order(sb, spec, env, res, threads, rank)
            else:  # a hot spare built for this rank: its promotion order is the round's environment
                promotion = {"env": env, "rebuild": rebuild}
                sb.proc.stdin.write((json.dumps(promotion) + "\n").encode())
                sb.proc.stdin.flush()
            orders = None
            if self.in_process:
                orders = sb.proc.stdin  # the next rounds' orders go the same way
            else:
                sb.proc.stdin.close()
            os.close(sb.write_fd)
            return Worker(rank, sb.proc.pid), sb.proc, sb.read_fd, orders
        r, w = os.pipe()
        full_env = {
            **os.environ,
            **env,
            Env.CONTROL_FD: str(w),
            Env.SPAWN_T: str(time.time()),
        }
        log = _prepare_log(spec.log_path(rank))
        out = open(log, "ab") if log else None  # noqa: SIM115 - handed to the child, closed right after
        try:
            with _forked_affinity(res.cpus):
                proc = subprocess.Popen(
                    spec.command,
                    env=full_env,
                    pass_fds=(w,),
                    start_new_session=True,
                    stdout=out,
                    stderr=subprocess.STDOUT if out else None,
                )
        finally:
            if out:
                out.close()
        os.close(w)
        return Worker(rank, proc.pid), proc, r, None

    def after_failure(self, attempt: Attempt, ledger: EventSink, blame: Blame | None = None) -> Verdict:
        """With ``min_nproc``: drop a slot blamed for ``slot_failures`` failures in a row, if enough remain.

        A loss spike is the data's or the model's, not a slot's: it neither counts nor resets the count.
        """
        if self.min_nproc is None or blame is None or self.slots is None:
            return CONTINUE
        if blame.cause == E.FailureCause.SPIKE:
            return CONTINUE
        local = blame.rank - attempt.spec.node_rank * attempt.spec.nproc_per_node
        if not 0 <= local < len(self.slots):
            return CONTINUE
        slot = self.slots[local]
        count = self._strikes[1] + 1 if self._strikes and self._strikes[0] == slot else 1
        self._strikes = (slot, count)
        if count < self.slot_failures or len(self.slots) <= self.min_nproc:
            return CONTINUE  # at the floor: keep restarting on every slot (the restart budget decides)
        self.slots.remove(slot)
        self.dropped.append(slot)
        self._strikes = None
        reason = (
            f"slot {slot} failed {count} times in a row ({blame.cause.value}); "
            f"continuing with {len(self.slots)} worker(s), --min-nproc {self.min_nproc}"
        )
        ledger.emit(
            E.SlotDropped(
                slot=slot, failures=count, nproc=len(self.slots), reason=reason, attempt=attempt.spec.attempt
            )
        )
        print(f"gpufleet: {reason}", file=sys.stderr)
        self._discard_standbys()  # they were started for the old world size
        return CONTINUE

    def close(self) -> None:
        self._discard_standbys()
        if self._warm is not None:
            self._warm.close()
            self._warm = None
        if self._spare_dir is not None:
            shutil.rmtree(self._spare_dir, ignore_errors=True)

    # -- helpers -------------------------------------------------------------------------------
    def active_slots(self, spec: LaunchSpec) -> list[int]:
        """The worker slots in use; the first call takes ``spec.nproc_per_node`` of them."""
        if self.slots is None:
            if self.min_nproc is not None and self.min_nproc > spec.nproc_per_node:
                raise ConfigError(
                    f"--min-nproc {self.min_nproc} is more than --nproc-per-node {spec.nproc_per_node}"
                )
            self.slots = list(range(spec.nproc_per_node))
        return self.slots

    def _plan(self, spec: LaunchSpec, nproc: int) -> list[RankResources]:
        key = (nproc, spec.cpu_affinity)
        if key not in self._plans:
            affinity = parse_cpu_affinity(spec.cpu_affinity)
            if self.dropped and affinity.lists:  # explicit lists belong to slots: keep the live ones'
                affinity = type(affinity)(affinity.mode, tuple(affinity.lists[s] for s in self.slots or ()))
            self._plans[key] = host_plan(nproc, affinity)
            note = thread_note(self._plans[key], {**os.environ, **spec.forward, **spec.env})
            if note and not self._noted:
                print(note, file=sys.stderr)
                self._noted = True
        return self._plans[key]

    def _take_standby(self, rank: int, world: int, local_rank: int) -> _Standby | None:
        """The hot spare built for this rank, else a plain standby of this slot (or one that warmed no
        GPU); never another rank's spare, nor a standby holding another GPU's CUDA context."""
        for sb in [sb for sb in self._standbys if sb.proc.poll() is not None]:  # exited: forget it
            self._standbys.remove(sb)
            os.close(sb.read_fd)
            os.close(sb.write_fd)
        for sb in self._standbys:
            if (sb.rank, sb.world) == (rank, world) and sb.hot():
                self._standbys.remove(sb)
                return sb
        plain = [sb for sb in self._standbys if sb.rank is None and (sb.slot == local_rank or not sb.gpu)]
        plain.sort(key=lambda sb: sb.slot != local_rank)  # its own slot's first: its CPUs, its GPU
        if plain:
            self._standbys.remove(plain[0])
            return plain[0]
        return None  # a spare still building stays for a later failure

    def _discard_standbys(self) -> None:
        for sb in self._standbys:
            if sb.proc.stdin is not None:
                sb.proc.stdin.close()  # EOF: the standby exits by itself
            if sb.proc.forked:
                send_signal(sb.proc, signal.SIGTERM, group=True)
            else:
                sb.proc.cancel()  # still waiting for the zygote's imports: never made
            sb.proc.wait()
            os.close(sb.read_fd)
            os.close(sb.write_fd)
        self._standbys.clear()


_Launched = tuple[Worker, "subprocess.Popen[bytes]", int, Any]  # worker, process, event fd, order pipe


def _attempt(spec: LaunchSpec, launched: list[_Launched]) -> ProcessAttempt:
    orders = {w.rank: o for w, _, _, o in launched if o is not None}
    return ProcessAttempt(spec, [(w, p, fd) for w, p, fd, _ in launched], group=True, orders=orders)


AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"  # torch.distributed.rendezvous reads it


def visible_devices(slots: list[int], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES naming the GPUs of ``slots`` (once a slot was dropped), so LOCAL_RANK i is
    live slot i's GPU: slot k's GPU is the k-th of the inherited list, else GPU k."""
    listed = Platform.CUDA_VISIBLE_DEVICES.raw(environ) or ""
    ids = [d.strip() for d in listed.split(",")] if listed.strip() else None
    visible = ",".join(ids[s] if ids and s < len(ids) else str(s) for s in slots)
    return {Platform.CUDA_VISIBLE_DEVICES: visible}


@contextlib.contextmanager
def _forked_affinity(cpus: frozenset[int] | None) -> Iterator[None]:
    """Run the body (a fork) with this thread's CPU mask set to ``cpus``: the child inherits it."""
    if cpus is None:
        yield
        return
    old = os.sched_getaffinity(0)  # pid 0: this thread only (Linux)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, old)


def _prepare_log(path: str | None) -> str | None:
    if path is not None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
    return path

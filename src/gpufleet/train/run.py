"""The worker-side Run API: ``init`` -> ``restore`` -> ``steps`` -> ``log`` -> ``finish``.

Under ``gpufleet run`` a worker talks to its supervisor over an inherited pipe (heartbeats, progress,
checkpoint events); standalone, rank 0 writes the run directory's ledger itself.

Per step, ranks agree on one small all-reduced control vector: [loss, non-finite, stop, save-due].
So every rank takes the same decisions (roll back, checkpoint now, stop) at the same step boundary,
without an extra collective when ``run.log`` is called.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed as dist

from gpufleet.core import events as E
from gpufleet.core.errors import CheckpointError, ConfigError, RebuildRound, SpikeDetected
from gpufleet.core.exitcodes import ExitCode
from gpufleet.core.ledger import EventSink, Ledger, NullSink, PipeSink, read_events
from gpufleet.core.settings import Env, RunSettings, read_env
from gpufleet.train.faults import FaultInjector, faults_from_env
from gpufleet.train.peerloss import survivable
from gpufleet.train.spike import SpikeGuard
from gpufleet.train.statedict import StateMapper

if TYPE_CHECKING:  # the engine is imported where it is first made: not in a rank that never saves
    from gpufleet.checkpoint import CheckpointEngine, LoadResult

__all__ = ["Run", "init", "SpikeDetected", "RebuildRound"]


# How long an abandoned round's checkpoint engine may take to notice its dead peer and stop.
_ABANDON_WAIT_S = 5.0


def _setup_distributed(choice: str, *, placeholder: bool = False) -> tuple[int, int, int, torch.device]:
    """This rank's process group (the default one) and device. ``placeholder``: a hot spare's group,
    which claims the world size and rank it was told and connects to nobody (torch's fake backend:
    collectives return at once), so the script can build its model and wrap it in DDP before the
    spare has a round to join."""
    from gpufleet.backends.resources import dist_plan

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", str(rank)))
    plan = dist_plan(choice, local, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    device = torch.device(plan.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        if placeholder:
            from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        else:
            dist.init_process_group(backend=plan.backend)
    return rank, world, local, device


def _read_order() -> dict[str, Any]:
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


def carries_cpu(backend: str) -> bool:
    """Whether a process group made with this backend string runs collectives on CPU tensors."""
    entries = backend.lower().split(",")
    if any(":" in e for e in entries):  # "cpu:gloo,cuda:nccl": only the device types it names
        return any(e.split(":")[0] == "cpu" for e in entries)
    return any(e in ("gloo", "mpi", "ucc") for e in entries)


class Run:
    """One worker's view of a (possibly supervised) training run. Create it with :func:`gpufleet.init`."""

    def __init__(self, settings: RunSettings, init_kwargs: dict[str, Any] | None = None) -> None:
        t_init = time.time()
        self.settings = settings
        self._init_kwargs = dict(init_kwargs or {})  # a rejoined round reloads its settings with them
        # A hot spare (the local backend's, under --in-process-restart): it builds for this rank and
        # waits in restore() for its promotion (see _promote).
        spare = os.environ.pop(Env.SPARE, None)
        self._spare = int(spare) if spare else None
        self.rank, self.world_size, self.local_rank, self.device = _setup_distributed(
            settings.dist_backend, placeholder=self._spare is not None
        )
        self.run_dir = Path(settings.run_dir)
        self.is_main = self.rank == 0
        self.supervised = settings.control_fd is not None
        # Under the in-process harness: a peer's death is survived in place at the step boundary.
        self._in_place = self.supervised and self.world_size > 1 and os.environ.get(Env.IN_PROCESS) == "1"
        self._errored: str | None = None  # a collective failed this round (the step is discarded)
        self.sink: EventSink
        if self._spare is not None:
            self.sink = NullSink()  # nothing to say until it is a rank of a round
        elif self.supervised:
            assert settings.control_fd is not None
            self.sink = PipeSink(settings.control_fd, self.rank)
        elif self.is_main:
            self.sink = Ledger(self.run_dir, session=f"standalone-{uuid.uuid4().hex[:8]}")
            self.sink.emit(
                E.RunStart(world_size=self.world_size, backend="standalone", command=tuple(sys.argv))
            )
        else:
            self.sink = NullSink()
        self._ckpt_pg: Any = None
        self._ctl_pg: Any = None
        if self._spare is None:
            self._make_groups()
        self._faults = FaultInjector(
            faults_from_env(settings.faults), self.rank, self.sink.emit, settle=self._settle_checkpoint
        )
        self._guard = SpikeGuard(
            window=settings.spike_window, threshold=settings.spike_threshold, level_frac=settings.spike_level
        )
        self._skips: list[list[int]] = [list(w) for w in settings.rollback.skip]
        self._engine: Any = None
        self._policy: Any = None
        self._mapper: StateMapper | None = None
        self._ddp: Any = None  # exactddp.DDPWatcher with 3+ ranks or in place: exact resume, rejoin
        self._restored_layout: Any = None  # the restored checkpoint's DDP bucket layout
        # In place (train/held.py): the last round's engine, whose staging buffers and snapshot the next
        # one takes over; a spare's reader of commits and what it preloaded into its objects.
        self._carry: Any = None
        self._reader: Any = None
        self._preload_refused = False  # a hot spare whose node cannot hold its preloads (_preload_fits)
        self._held: Any = None
        self._emptied: list[tuple[dict[str, Any], Any]] = []  # param lists a discarded step set aside
        self._start = 0
        self.step = 0
        self.epoch = 0
        self.steps_per_epoch: int | None = None
        self._stall = 0.0
        self._ctrl_done = False
        self._save_due = False
        self._stop_requested = False
        self._stop_agreed = False
        self._last_loss: float | None = None
        self._finished = False
        self._last_saved_step = -1
        self._progressed = False  # did the current step change the state (for `break`)?
        self._ckpt_obs: dict[str, float] = {}  # latest stall/persist seconds, fed to the interval policy
        # This step's per-rank timings, for the supervisor's straggler detector (sent at the control
        # all-reduce): when the step started, and the first forward's end, less checkpoint stall.
        self._step_t0 = time.monotonic()
        self._fwd_s: float | None = None
        signal.signal(signal.SIGUSR1, self._on_stop_signal)
        global _CURRENT
        _CURRENT = self  # the in-process restart harness abandons it if a peer dies (inprocess.py)
        spawn_t = read_env(Env.SPAWN_T, float, t_init)
        self.sink.emit(E.WorkerReady(attempt=settings.attempt, init_s=round(time.time() - spawn_t, 4)))

    def _make_groups(self) -> None:
        # A separate gloo group so background checkpoint collectives never interleave with training's.
        self._ckpt_pg = dist.new_group(backend="gloo") if self.world_size > 1 else None
        # The per-step control all-reduce is a CPU tensor. gpufleet's own group carries those (gloo,
        # or cpu:gloo,cuda:nccl); a NCCL-only group the script made itself before init() cannot.
        self._ctl_pg = None
        if self.world_size > 1 and not carries_cpu(str(dist.get_backend())):
            self._ctl_pg = dist.new_group(backend="gloo")

    # ------------------------------------------------------------------ rounds in place
    def _survivable(self, exc: BaseException) -> bool:
        """Whether this error is a dead peer's that the step boundary can absorb. Not with a DDP the run
        cannot move to a new group (one with the script's own communication hook): its error escapes
        the step, and the in-process harness takes over (it runs the script again)."""
        if not self._in_place or (self._ddp is not None and self._ddp.foreign):
            return False
        return survivable(exc)

    def _note_error(self, exc: BaseException) -> None:
        if self._errored is None:
            first = str(exc).splitlines()[0][:300] if str(exc) else ""
            self._errored = f"{type(exc).__name__}: {first}"

    def _round_error(self) -> str | None:
        """This round's collective failure, from the run's own collectives or DDP's (the hook)."""
        if self._errored is None and self._ddp is not None:
            exc = self._ddp.errored()
            if exc is not None:
                self._note_error(exc)
        return self._errored

    def _reform(self, *, hot_spare: bool = False) -> None:
        """Join the round the order (already applied to the environment) describes: settings again,
        a new default group with the replacement rank, gpufleet's own groups, the fault plan."""
        t0 = time.time()
        self.settings = settings = RunSettings.load(**self._init_kwargs)
        self.rank, self.world_size, self.local_rank, self.device = _setup_distributed(settings.dist_backend)
        self.is_main = self.rank == 0
        if self.supervised and isinstance(self.sink, NullSink):
            assert settings.control_fd is not None
            self.sink = PipeSink(settings.control_fd, self.rank)
        self._make_groups()
        self._faults = FaultInjector(
            faults_from_env(settings.faults), self.rank, self.sink.emit, settle=self._settle_checkpoint
        )
        self._skips = [list(w) for w in settings.rollback.skip]
        spawn_t = read_env(Env.SPAWN_T, float, t0)
        init_s = round(time.time() - spawn_t, 4)
        self.sink.emit(E.WorkerReady(attempt=settings.attempt, init_s=init_s, hot_spare=hot_spare))

    def _promote(self) -> None:
        """A hot spare: wait for the order that makes it a rank, then leave the placeholder group for
        the round's. Its model and optimizer were built meanwhile; restore() then loads their state."""
        # What the restore imports on first use (the checkpoint engine, DCP's readers: 40 ms measured
        # on the promoted spare's critical path), imported while there is nothing else to do.
        import gpufleet.checkpoint.engine  # noqa: F401
        import gpufleet.reliability.interval  # noqa: F401
        import gpufleet.train.exactddp  # noqa: F401

        ready = os.environ.pop(Env.SPARE_READY, None)
        if ready:  # built: the backend may now promote it as it is (a spare still building is not hot)
            with open(ready, "w"):
                pass
        preloader = None
        if self._in_place:  # each new commit loaded into the objects while it waits (train/held.py)
            from gpufleet.train.held import Preloader

            preloader = Preloader(self.settings.ckpt_dir, self.settings.rollback.max_step, self._preload)
            preloader.start()
        try:
            _read_order()
        finally:
            if preloader is not None:
                preloader.stop()
        rank = int(os.environ.get("RANK", "0"))
        if rank != self._spare:
            raise RebuildRound(f"a spare built for rank {self._spare} was promoted to rank {rank}")
        self._spare = None
        dist.destroy_process_group()
        self._reform(hot_spare=True)
        if preloader is not None:
            self._held = preloader.catch_up(self.settings.rollback.max_step)
            self._carry, self._reader = self._reader, None  # its staging buffers serve the saves

    def _preload(self, step: int) -> Any:
        """A hot spare's verified load of commit ``step`` into its objects, on its own (it has no group
        yet): what it holds at its promotion (train/held.py), or None when there is nothing to load."""
        from gpufleet.checkpoint import CheckpointConfig, CheckpointEngine
        from gpufleet.train.held import Held

        assert self._mapper is not None
        if self._reader is None:  # the first preload allocates what the spare holds from then on
            if not self._preload_fits(step):
                return None
            cfg = CheckpointConfig(dir=str(self.settings.ckpt_dir), read_only=True)
            self._reader = CheckpointEngine(cfg, rank=0, world_size=1)
        result = self._load_primed(self._reader, step)
        if result is None:
            return None
        skips = self._apply_loaded(result.state_dict, int(result.step), result.meta, preload=True)
        return Held(
            step=int(result.step), path=result.path, source=result.source, meta=result.meta, skips=skips
        )

    def _preload_fits(self, step: int) -> bool:
        """Whether this node's spares (one per local rank) can each hold a commit's state ahead of
        their promotion: half the available memory at most, as for a snapshot. Decided once: a spare
        refused holds nothing and loads as usual once promoted (one warning)."""
        from gpufleet.checkpoint.staging import available_memory, local_ranks, within_half
        from gpufleet.train.held import commit_bytes

        if self._preload_refused:
            return False
        size, avail = commit_bytes(self.settings.ckpt_dir, step), available_memory()
        ranks = local_ranks(self.world_size)
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

    def _rejoin_in_place(self) -> int:
        """A peer died during this step: discard the step, leave the broken round without a collective,
        rejoin the next one with the same objects and roll them back to the newest checkpoint (the
        memory tier first). Returns the step to resume at."""
        t0 = time.monotonic()
        reason = self._errored or "collective failed"
        if self._engine is not None:
            try:
                self._engine.wait(timeout=_ABANDON_WAIT_S)  # a save that needed the dead peer stops
            except Exception:  # noqa: BLE001 - the ledger has it (ckpt_failed); the new round saves again
                pass
            if not self._engine.persisting():  # its buffers are nobody's now: the next engine takes them
                self._carry = self._engine
        self._engine = None  # bound to the broken groups; restore makes a new one
        try:
            dist.destroy_process_group()  # the default group and every group made from it
        except Exception:  # noqa: BLE001 - a half-dead group may fail to tear down; the new round makes its own
            pass
        assert self._mapper is not None
        self._restore_param_lists()  # had the optimizer step raised, they would still be set aside
        self._mapper.drop_gradients()  # as a fresh rank has them: none
        self.sink.emit(E.Rejoin(reason=reason[:300], abort_s=round(time.monotonic() - t0, 6), in_place=True))
        _read_order()
        self._errored = None
        self._reform()
        start = self._load_state()
        if self._ddp is not None:
            self._ddp.rejoin(self._restored_layout)
        self._save_due = False
        self._stall = 0.0
        return start

    # ------------------------------------------------------------------ checkpoint plumbing
    def _on_stop_signal(self, signum: int, frame: object) -> None:
        self._stop_requested = True
        # One request is enough, and it can come twice: under Slurm the step's signal reaches every
        # process of the step and the node agent forwards it too. A duplicate must not kill the rank
        # while it checkpoints and exits (Python's finalization puts SIG_DFL back, but not SIG_IGN).
        _set_stop_handler(signal.SIG_IGN)

    def _ensure_engine(self) -> Any:
        if self._engine is None:
            from gpufleet.checkpoint import CheckpointConfig, CheckpointEngine
            from gpufleet.reliability.interval import IntervalPolicy

            s = self.settings
            cfg = CheckpointConfig(
                dir=str(s.ckpt_dir),
                upload_url=s.upload_url,
                s3_endpoint=s.s3_endpoint,
                keep_last=s.keep_last,
                keep_window_steps=s.spike_window,
                memory_bytes=self._memory_budget(),
                keep_snapshot=self._in_place,  # a survivor rolls back from it (train/held.py)
            )
            self._engine = CheckpointEngine(
                cfg,
                rank=self.rank,
                world_size=self.world_size,
                process_group=self._ckpt_pg,
                sink=_ObservingSink(self.sink, self._ckpt_obs),
                previous=self._carry,
            )
            if self._carry is not None:
                # The last round's engine goes on a thread: the teardown of its (already destroyed)
                # gloo groups joins their threads, 19 ms measured on a survivor's way back to training.
                old, self._carry = [self._carry], None
                threading.Thread(target=old.clear, name="gpufleet-release", daemon=True).start()
            mtbf, source = self._mtbf_estimate()
            self._policy = IntervalPolicy.parse(s.checkpoint_every, mtbf_s=mtbf, mtbf_source=source)
        return self._engine

    def _memory_budget(self) -> int:
        """The in-memory tier's budget. With ranks on several nodes (``LOCAL_WORLD_SIZE`` <
        ``WORLD_SIZE``) the engine replicates each node's part to a peer node's memory
        (checkpoint/peer.py); on one node it keeps whole checkpoints (checkpoint/memtier.py)."""
        return self.settings.memory_tier

    def _mtbf_estimate(self) -> tuple[float | None, str]:
        """M for the auto interval, from this run directory's failure history and the configured value.

        A configured M acts as one pseudo-failure observed over M seconds (a conjugate prior), so a
        single early failure does not swing the interval: M = (uptime + M_cfg) / (failures + 1).
        """
        configured = self.settings.mtbf_s
        if not self.is_main or self.settings.checkpoint_every != "auto":
            return configured, "configured"
        from gpufleet.reliability.metrics import mtbf

        _, uptime, failures = mtbf(read_events(self.run_dir))
        if failures == 0:
            return configured, "configured"
        if configured is None:
            return (uptime / failures if uptime > 0 else None), "history"
        return (uptime + configured) / (failures + 1), "history+configured"

    def _internal_state(self) -> dict[str, Any]:
        return {"guard": self._guard.state_dict(), "skips": self._skips}

    def _settle_checkpoint(self) -> None:
        """For ``settle=1`` drills: let the in-flight save commit (or fail) before the fault fires."""
        if self._engine is None:
            return
        try:
            self._engine.wait()
        except CheckpointError:
            pass  # already in the ledger as ckpt_failed; the drill goes on

    def restore(self, state: dict[str, Any]) -> int:
        """Load the newest verified checkpoint into ``state``'s objects; return the step to resume at."""
        try:
            self._mapper = StateMapper(state, self.rank)
        except ConfigError as e:  # the same script fails the same way after a restart
            if self.supervised:
                _exit_config_error(str(e))
            raise
        if self._spare is not None:  # a hot spare: built; now wait to become a rank
            self._promote()
            self._mapper.rank = self.rank
        if self.supervised and self.world_size > 1 and self._mapper.model is not None:
            self._mapper.model.register_forward_hook(self._after_forward)
        for opt in self._mapper.optimizers:
            opt.register_step_pre_hook(self._before_optimizer_step)
            opt.register_step_post_hook(self._after_optimizer_step)
        self._load_state()
        if (self.world_size >= 3 or self._in_place) and self._mapper.model is not None:
            from gpufleet.train.exactddp import DDPWatcher

            tolerate = self._survivable if self._in_place else None
            self._ddp = DDPWatcher(self._mapper.model, saved=self._restored_layout, tolerate=tolerate)
        return self._start

    def _load_primed(self, engine: CheckpointEngine, max_step: int | None) -> LoadResult | None:
        """The newest verified commit at or below ``max_step`` loaded into the objects, or None.

        The load's template needs optimizer state: shaped from the checkpoint's metadata where it
        can be, else torch makes it with a fake step. It is made only once there is a checkpoint
        to load (a fresh start makes none), and an optimizer that had no state gets none back
        when nothing is loaded: a fresh run starts as the same script would without us (a fake
        AdamW step leaves step=1 behind and changes every later update)."""
        assert self._mapper is not None
        mapper = self._mapper
        stateless = [opt for opt in mapper.optimizers if not opt.state]

        def template() -> dict[str, Any]:
            mapper.prime_optimizers(engine.newest_metadata(max_step))
            sd = mapper.collect()
            sd["_gpufleet"] = self._internal_state()
            return sd

        try:
            result = engine.load(template, max_step=max_step, optional=mapper.rank_entries())
        except BaseException:
            mapper.unprime(stateless)
            raise
        if result is None:
            mapper.unprime(stateless)
        return result

    def _load_state(self) -> int:
        """Load the newest verified checkpoint into the restore dict's objects (those of a fresh start,
        or a survivor's own, rolled back in place); sets the step to resume at."""
        assert self._mapper is not None
        engine = self._ensure_engine()
        max_step = self.settings.rollback.max_step
        t0 = time.monotonic()
        if self._in_place and self._restore_held(engine, max_step, t0):
            return self._start
        result = self._load_primed(engine, max_step)
        self._restored_layout = None
        if result is None:
            self.sink.emit(E.Restore(step=0, fresh=True, load_s=round(time.monotonic() - t0, 4)))
            self._start = 0
        else:
            saved_world = result.meta.get("world_size")
            skips = self._apply_loaded(result.state_dict, int(result.step), result.meta)
            # Skip windows decided by the supervisor win over those saved with the checkpoint.
            self._skips = self._skips or skips
            self.sink.emit(
                E.Restore(
                    step=self._start,
                    fresh=False,
                    path=result.path,
                    source=result.source,
                    # read + verify + apply: all of it blocks the restart
                    load_s=round(time.monotonic() - t0, 4),
                    saved_world_size=saved_world if saved_world != self.world_size else None,
                )
            )
        self._resume_at(self._start)
        return self._start

    def _resume_at(self, step: int) -> None:
        self._start = self._last_saved_step = self.step = step
        self._policy.reset(step, time.time())

    def _apply_loaded(
        self, sd: dict[str, Any], step: int, meta: dict[str, Any], *, preload: bool = False
    ) -> list[list[int]]:
        """Put a loaded state dict (of commit ``step``) into the objects; returns its skip windows.
        ``preload``: a spare's, on its preload thread: an error is the preload's, not the process's."""
        assert self._mapper is not None
        try:
            self._mapper.check_world_size(meta.get("world_size"), self.world_size)
            self._mapper.apply(sd, step=step)
        except ConfigError as e:  # the objects no longer fit the checkpoint (a changed data loader)
            if self.supervised and not preload:
                _exit_config_error(str(e))
            raise
        internal = sd.get("_gpufleet", {})
        if "guard" in internal:
            self._guard.load_state_dict(internal["guard"])
        self._start = step
        self._restored_layout = meta.get("ddp_buckets")
        return [list(w) for w in internal.get("skips", [])]

    def _restore_held(self, engine: Any, max_step: int | None, t0: float) -> bool:
        """In place: restore from what every rank of the round already holds (train/held.py), when all
        hold the newest commit: a survivor its engine's snapshot, a promoted spare its preload. False:
        the round loads from storage. A collective: every rank of the round calls it."""
        from gpufleet.checkpoint.snapshot import SnapshotMismatch
        from gpufleet.train.held import agree, newest_commit

        assert self._mapper is not None
        held, self._held = self._held, None
        snap = engine.snapshot(max_step)
        step: int | None = None
        template: dict[str, Any] | None = None
        if snap is not None:
            t_verify = time.monotonic()
            reason = snap.verify()
            if reason is None and self.is_main:
                self.sink.emit(
                    E.CkptVerified(
                        step=snap.step,
                        path=snap.path,
                        verify_s=round(time.monotonic() - t_verify, 6),
                        source=E.RestoreSource.PROCESS,
                    )
                )
            if reason is None:
                template = self._mapper.collect()
                template["_gpufleet"] = self._internal_state()
                try:
                    snap.check(template)
                    step = snap.step
                except SnapshotMismatch as e:
                    reason, template = str(e), None
            if reason is not None:
                self.sink.emit(
                    E.RestoreRejected(path=snap.path, step=snap.step, reason=f"in-process copy: {reason}")
                )
        elif held is not None and (max_step is None or held.step <= max_step):
            step = held.step
        if not agree(step, newest_commit(self.settings.ckpt_dir, max_step), self._ctl_pg):
            return False
        assert step is not None
        if template is not None and snap is not None:
            snap.copy_into(template)
            skips = self._apply_loaded(template, step, snap.meta)
            path, source = snap.path, E.RestoreSource.PROCESS
        else:
            assert held is not None
            skips, path, source = held.skips, held.path, E.RestoreSource(held.source)
        self._skips = self._skips or skips
        self.sink.emit(
            E.Restore(
                step=step,
                fresh=False,
                path=path,
                source=source,
                load_s=round(time.monotonic() - t0, 4),
                preloaded=True,
            )
        )
        self._resume_at(step)
        return True

    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        # The staging copy overlapped forward/backward; parameters change now, so it must be done.
        if self._engine is not None:
            self._stall += self._engine.wait_staged()
        if self._in_place and self._round_error() is not None:
            # A discarded step (a peer died in its all-reduce): its update would be rolled back, so the
            # optimizer steps over no parameters instead; the recovery starts that much sooner (an
            # AdamW step is a third of P3's step). The lists come back right after the step.
            self._emptied.extend((group, group["params"]) for group in optimizer.param_groups)
            for group in optimizer.param_groups:
                group["params"] = []

    def _after_optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        self._restore_param_lists()
        self._progressed = True
        if self._ddp is not None:
            self._ddp.stop_watching()

    def _restore_param_lists(self) -> None:
        for group, params in self._emptied:
            group["params"] = params
        self._emptied.clear()

    def _after_forward(self, *args: Any) -> None:
        # The first forward of the step (gradient accumulation runs several): data loading and forward
        # happen before DDP's gradient all-reduce, so a slow rank shows here even under DDP.
        if self._fwd_s is None:
            self._fwd_s = time.monotonic() - self._step_t0 - self._stall

    def _save(self, step: int, *, force: bool = False) -> None:
        assert self._mapper is not None
        engine = self._ensure_engine()
        sd = self._mapper.collect()
        sd["_gpufleet"] = self._internal_state()
        meta = {
            "epoch": self.epoch,
            "step": step,
            "steps_per_epoch": self.steps_per_epoch,
            "world_size": self.world_size,
        }
        layout = None if self._ddp is None else self._ddp.checkpoint_layout()
        if layout:  # DDP's rebuilt buckets: a resume replays its first all-reduce in them
            meta["ddp_buckets"] = layout
        fault = self._faults.checkpoint_fault(step)
        kind = None if fault is None else ("fail" if fault.kind == "ckpt_fail" else "corrupt")
        deferred = self._mapper.deferred_keys() if self.settings.overlap_staging and not force else None
        t0 = time.monotonic()
        started = engine.save(step, sd, meta=meta, deferred=deferred, force=force, fault=kind)
        self._stall += time.monotonic() - t0
        if started and fault is not None:
            self._faults.fired(fault, step)
        if started:
            self._last_saved_step = step
            if self.is_main:
                self._policy.saved(step, time.time())

    # ------------------------------------------------------------------ the step loop
    def _control(self, loss: float | None) -> float | None:
        """All-reduce [loss, non-finite, stop, save-due] once per step; returns the mean loss."""
        due = self.is_main and self._policy is not None and self._policy.due(self.step + 1, time.time())
        nonfinite = loss is not None and not math.isfinite(loss)
        vec = torch.tensor(
            [
                0.0 if (loss is None or nonfinite) else loss,
                float(nonfinite),
                float(self._stop_requested),
                float(due),
            ],
            dtype=torch.float64,
        )
        if self.world_size > 1:
            if self.supervised:  # "waiting on peers": lets the hang detector blame the rank that never came
                work = time.monotonic() - self._step_t0 - self._stall
                self.sink.emit(
                    E.Heartbeat(
                        step=self.step,
                        phase=E.HeartbeatPhase.SYNC,
                        work=round(work, 6),
                        fwd=None if self._fwd_s is None else round(self._fwd_s, 6),
                    )
                )
            if self._errored is None:
                try:
                    dist.all_reduce(vec, group=self._ctl_pg)
                except Exception as e:
                    if not self._survivable(e):
                        raise
                    self._note_error(e)  # the step is discarded at its end; this rank's own values stand
            if self._errored is not None:
                vec[2] = vec[3] = 0.0  # no decisions in a discarded step
        self._ctrl_done = True
        total, n_nonfinite, stop, save = vec.tolist()
        self._save_due = save > 0
        self._stop_agreed = stop > 0
        if loss is None:
            return None
        return float("nan") if n_nonfinite > 0 else total / self.world_size

    def _in_skip(self, step: int) -> int | None:
        for a, b in self._skips:
            if a <= step < b:
                return b
        return None

    def _skip_loader_batches(self, n: int) -> None:
        """A skipped window skips its batches too: a ``gpufleet.resumable`` loader in the restore dict is
        advanced by the skipped steps' batches (a StepSampler needs nothing: its batch is a function of
        the step), so the steps after the window train on the batches they would have had."""
        from gpufleet.train.data import ResumableLoader

        assert self._mapper is not None
        for obj in self._mapper.state.values():
            if isinstance(obj, ResumableLoader):
                for _ in range(n):
                    next(obj)

    def steps(self, total: int, *, steps_per_epoch: int | None = None) -> Iterator[int]:
        """Yield global step numbers from the restored step to ``total`` (exclusive)."""
        if self._mapper is None:
            raise ConfigError("call run.restore(state) before run.steps()")
        if total < 0 or (steps_per_epoch is not None and steps_per_epoch <= 0):
            raise ConfigError("total must be >= 0 and steps_per_epoch > 0")
        self.steps_per_epoch = steps_per_epoch
        step = self._start
        while step < total:
            resume = self._in_skip(step)
            if resume is not None:
                self.sink.emit(E.Skip(skipped_from=step, skipped_to=resume))
                self._skip_loader_batches(resume - step)
                step = resume
                continue
            self.step = step
            self.epoch = step // steps_per_epoch if steps_per_epoch else 0
            t0 = time.monotonic()  # a step's dt includes the checkpoint stall taken at its start
            self._step_t0, self._fwd_s = t0, None
            if self._save_due and step > self._last_saved_step:
                try:
                    self._save(step)
                except Exception as e:
                    if not self._survivable(e):
                        raise
                    self._note_error(e)
                    step = self._rejoin_in_place()
                    continue
            self._save_due = False
            self._faults.before_step(step)
            if self.supervised:
                # Every step: a rank blocked in a peer's collective (DDP's backward) must have said it
                # reached this step, or the hang detector cannot tell it from the rank that hangs.
                self.sink.emit(E.Heartbeat(step=step, total=total))
            self._ctrl_done = False
            self._progressed = False
            try:
                yield step
            except GeneratorExit:
                # The loop body ended with `break`. The step counts as done when it changed the state
                # (an optimizer step ran; without optimizers, run.log was called), so the final
                # checkpoint resumes after it; a break at the top of the body leaves it undone.
                # No collective here: peers may not break.
                if self._progressed:
                    if self.is_main:
                        self._record_step(step, time.monotonic() - t0)
                    self.step = step + 1
                raise
            if not self._ctrl_done:
                self._control(None)
            if self._in_place and self._round_error() is not None:
                step = self._rejoin_in_place()  # this step is discarded: the state rolls back
                continue
            dt = time.monotonic() - t0
            if self.is_main:
                self._record_step(step, dt)
            self._stall = 0.0
            step += 1
            if self._stop_agreed:
                self._stop(step)
        self.step = total

    def _record_step(self, step: int, dt: float) -> None:
        self.sink.emit(
            E.Step(
                step=step,
                epoch=self.epoch,
                dt=round(dt, 6),
                stall=round(self._stall, 6),
                loss=self._last_loss,
            )
        )
        self._last_loss = None
        if self.steps_per_epoch and (step + 1) % self.steps_per_epoch == 0:
            self.sink.emit(E.EpochEnd(epoch=self.epoch, step=step))
        obs = self._engine_observations()
        # A step overlapped a persist if one is still running or one committed during it: persist
        # and checksum threads take CPU from training, a cost the stall alone does not show.
        overlapped = "persist_s" in obs or (self._engine is not None and self._engine.persisting())
        decision = self._policy.observe(step_s=dt - self._stall, overlapped=overlapped, **obs)
        if decision:
            self.sink.emit(E.Interval(step=step, **decision))

    def _engine_observations(self) -> dict[str, float]:
        obs = dict(self._ckpt_obs)  # the observing sink holds this very dict: copy, then clear in place
        self._ckpt_obs.clear()
        return obs

    def log(self, **metrics: Any) -> float | None:
        """Record metrics; the loss passes the spike/NaN guard, agreed across ranks. Returns the mean loss."""
        loss = metrics.get("loss")
        if loss is None:
            return None
        value = float(loss.detach().item() if isinstance(loss, torch.Tensor) else loss)
        value = self._faults.loss(self.step, value)
        if self._mapper is not None and not self._mapper.optimizers:
            self._progressed = True
        mean = self._control(value)
        assert mean is not None
        if self._errored is not None:
            return mean  # a discarded step: not one for the guard's history
        self._last_loss = round(mean, 6) if mean == mean else None
        reason = self._guard.check(mean)
        if reason is not None:
            self._on_spike(reason, mean)
        return mean

    def _on_spike(self, reason: str, value: float) -> None:
        self.sink.emit(E.Spike(step=self.step, reason=reason, value=None if value != value else value))
        if not self.supervised:
            raise SpikeDetected(f"step {self.step}: {reason}")
        # Under a supervisor: every rank saw the same value, so every rank leaves here together.
        # A save still persisting holds a pre-spike state (taken before this step's update): let it
        # commit, so the rollback loses less work.
        if self._engine is not None:
            try:
                self._engine.wait(timeout=60.0)
            except CheckpointError:
                pass  # recorded as ckpt_failed by the engine; the rollback uses an older checkpoint
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(ExitCode.WORKER_SPIKE)

    def _stop(self, step: int) -> None:
        """Stop requested (SIGUSR1 from the supervisor or Slurm): final checkpoint, then exit 0."""
        self._heartbeat_phase("finish")
        if step > self._last_saved_step:
            self._save(step, force=True)
        if self._engine is not None:
            self._engine.wait()
        self._close("interrupted")
        sys.exit(0)

    def finish(self) -> None:
        """Take the final checkpoint, wait for it to persist, and close the run."""
        if self._finished:
            return
        self._heartbeat_phase("finish")
        if self._mapper is not None and self.step > self._last_saved_step:
            self._save(self.step, force=True)
        if self._engine is not None:
            self._engine.wait()
        self._close("completed")

    def abandon(self, wait_s: float) -> None:
        """Give this run up after a peer died (the in-process restart harness), with no collective: the
        in-flight checkpoint gets ``wait_s`` seconds to notice the dead peer and stop; SIGUSR1 gets its
        default handler back. The process group is the harness's to destroy."""
        self._finished = True
        if self._engine is not None:
            try:
                self._engine.wait(timeout=wait_s)
            except Exception:  # noqa: BLE001 - a save that cannot commit without its peer: the ledger has it
                pass
        _set_stop_handler(signal.SIG_DFL)

    def _heartbeat_phase(self, phase: str) -> None:
        # Tells the supervisor's hang detector that a long, step-less phase (final save) is starting.
        if self.supervised:
            self.sink.emit(E.Heartbeat(step=self.step, phase=E.HeartbeatPhase(phase)))

    def _close(self, status: str) -> None:
        self._finished = True
        _set_stop_handler(signal.SIG_IGN)  # the run is over: a late stop request is moot
        if self._engine is not None:
            self._engine.close()
        if not self.supervised and self.is_main:
            self.sink.emit(E.RunEnd(status=E.RunStatus(status), exit_code=0))
        if self.world_size > 1 and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


_CURRENT: Run | None = None


def _set_stop_handler(handler: Any) -> None:
    """SIGUSR1's disposition, where Python allows it: only the main thread may set one (Ray Train runs
    the loop in another thread, where the run has no stop handler to change; see gpufleet.ray)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGUSR1, handler)


def abandon_current(wait_s: float) -> None:
    """Let go of this process's :class:`Run` after a peer died (in-process restart), with no collective:
    give its in-flight checkpoint ``wait_s`` seconds to notice the dead peer and stop, restore the
    default SIGUSR1 handler, and forget it."""
    global _CURRENT
    run, _CURRENT = _CURRENT, None
    if run is not None:
        run.abandon(wait_s)


class _ObservingSink:
    """Passes checkpoint events on and keeps the latest stall and persist times for the interval policy."""

    def __init__(self, inner: EventSink, observed: dict[str, float]) -> None:
        self._inner = inner
        self._observed = observed

    def emit(self, event: E.Event | str, /, **fields: Any) -> None:
        if isinstance(event, str):
            event = E.make_event(event, **fields)
        match event:
            case E.CkptStaged(stall_s=stall_s):
                self._observed["stall_s"] = stall_s
            case E.CkptCommitted(persist_s=persist_s):
                self._observed["persist_s"] = persist_s
        self._inner.emit(event)


def init(**kwargs: Any) -> Run:
    """Create the :class:`Run` for this process (see :class:`gpufleet.core.settings.RunSettings` options).

    A setting that fails validation raises :class:`ConfigError`; under ``gpufleet run`` the worker
    instead prints it as one line and exits with ``ExitCode.WORKER_CONFIG``, which ends the run with
    exit code 2 (a restart would fail the same way).
    """
    try:
        settings = RunSettings.load(**kwargs)
    except ConfigError as e:
        if os.environ.get(Env.CONTROL_FD):
            _exit_config_error(str(e))
        raise
    return Run(settings, kwargs)


def _exit_config_error(message: str) -> NoReturn:
    """Under a supervisor: the message to the supervisor (which prints it once), then exit 78 (no restart)."""
    rank = os.environ.get("RANK", "0")
    # A control line like the heartbeat, read by the supervisor's monitor and never written to the
    # ledger (the settings that would name the run are what failed). Short enough for one atomic write.
    line = {"ev": "config_error", "t": time.time(), "rank": int(rank) if rank.isdigit() else 0}
    line["message"] = message[:1000]
    try:
        os.write(int(os.environ[Env.CONTROL_FD]), (json.dumps(line) + "\n").encode())
    except (ValueError, OSError):
        print(f"gpufleet: error: {message}", file=sys.stderr, flush=True)  # no usable channel
    sys.stdout.flush()
    os._exit(ExitCode.WORKER_CONFIG)

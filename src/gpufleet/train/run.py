"""The worker-side Run API: ``init`` -> ``restore`` -> ``steps`` -> ``log`` -> ``finish``.

Under ``gpufleet run`` a worker talks to its supervisor over an inherited pipe (heartbeats, progress,
checkpoint events); standalone, rank 0 writes the run directory's ledger itself.

Per step, ranks agree on one small all-reduced control vector: [loss, non-finite, stop, save-due].
So every rank takes the same decisions (roll back, checkpoint now, stop) at the same step boundary,
without an extra collective when ``run.log`` is called.
"""

from __future__ import annotations

import atexit
import gc
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
from gpufleet.core.env import Platform
from gpufleet.core.errors import ConfigError, SpikeDetected
from gpufleet.core.exitcodes import ExitCode
from gpufleet.core.launch import LaunchEnv
from gpufleet.core.ledger import EventSink, Ledger, NullSink, PipeSink
from gpufleet.core.settings import Env, RunSettings, read_env
from gpufleet.train import autostep
from gpufleet.train.checkpointing import Checkpointer
from gpufleet.train.faults import FaultInjector, faults_from_env
from gpufleet.train.held import Held
from gpufleet.train.recovery import Recovery
from gpufleet.train.spike import SpikeGuard
from gpufleet.train.statedict import StateMapper

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from gpufleet.train.exactddp import DDPWatcher, Layout

__all__ = ["Run", "init", "SpikeDetected"]


def _setup_distributed(choice: str, *, placeholder: bool = False) -> tuple[int, int, int, torch.device]:
    """This rank's process group (the default one) and device. ``placeholder``: a hot spare's group,
    which claims the world size and rank it was told and connects to nobody (torch's fake backend:
    collectives return at once), so the script can build its model and wrap it in DDP before the
    spare has a round to join."""
    from gpufleet.backends.resources import dist_plan

    place = LaunchEnv.from_environ()
    rank, world, local = place.rank, place.world_size, place.local_rank
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


def carries_cpu(backend: str) -> bool:
    """Whether a process group made with this backend string runs collectives on CPU tensors."""
    entries = backend.lower().split(",")
    if any(":" in e for e in entries):  # "cpu:gloo,cuda:nccl": only the device types it names
        return any(e.split(":")[0] == "cpu" for e in entries)
    return any(e in ("gloo", "mpi", "ucc") for e in entries)


class Run:
    """One worker's view of a (possibly supervised) training run. Create it with :func:`gpufleet.init`.

    It keeps the step loop, the control all-reduce, logging and the end of the run; checkpoints go
    through its :class:`~gpufleet.train.checkpointing.Checkpointer`, in-process recovery (a hot
    spare's promotion, a round rejoined in place) through its :class:`~gpufleet.train.recovery.Recovery`.
    """

    def __init__(self, settings: RunSettings, init_kwargs: dict[str, Any] | None = None) -> None:
        t_init = time.time()
        self.settings = settings
        self._init_kwargs = dict(init_kwargs or {})  # a rejoined round reloads its settings with them
        # A hot spare (the local backend's, under --in-process-restart): it builds for this rank and
        # waits in restore() for its promotion (Recovery.await_promotion).
        spare = os.environ.pop(Env.SPARE, None)
        spare_rank = int(spare) if spare else None
        self.rank, self.world_size, self.local_rank, self.device = _setup_distributed(
            settings.dist_backend, placeholder=spare_rank is not None
        )
        self.run_dir = Path(settings.run_dir)
        self.is_main = self.rank == 0
        self.supervised = settings.control_fd is not None
        # Under the in-process harness: a peer's death is survived in place at the step boundary.
        in_place = self.supervised and self.world_size > 1 and Env.IN_PROCESS.get()
        self._recovery = Recovery(spare=spare_rank, in_place=in_place)
        self.sink: EventSink
        if spare_rank is not None:
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
        self._ctl_pg: ProcessGroup | None = None
        ckpt_pg = self._make_groups() if spare_rank is None else None
        self._guard = SpikeGuard(
            window=settings.spike_window, threshold=settings.spike_threshold, level_frac=settings.spike_level
        )
        self._skips: list[list[int]] = [list(w) for w in settings.rollback.skip]
        self._ckpt = Checkpointer(
            settings,
            rank=self.rank,
            world_size=self.world_size,
            sink=self.sink,
            group=ckpt_pg,
            keep_snapshot=in_place,
            internal_state=self._internal_state,
        )
        self._faults = FaultInjector(
            faults_from_env(settings.faults), self.rank, self.sink.emit, settle=self._ckpt.settle
        )
        self._ddp: DDPWatcher | None = None  # with 3+ ranks or in place: exact resume, rejoin
        self._restored_layout: Layout | None = None  # the restored checkpoint's DDP bucket layout
        self._start = 0
        self._restored_from: str | None = None  # the checkpoint the last restore loaded
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
        self._progressed = False  # did the current step change the state (for `break`)?
        # This step's per-rank timings, for the supervisor's straggler detector (sent at the control
        # all-reduce): when the step started, and the first forward's end, less checkpoint stall.
        self._step_t0 = time.monotonic()
        self._fwd_s: float | None = None
        signal.signal(signal.SIGUSR1, self._on_stop_signal)
        autostep.yield_to_api()  # this Run reports the steps; the zero-code hook must not count them too
        global _CURRENT
        _CURRENT = self  # the in-process restart harness abandons it if a peer dies (inprocess.py)
        atexit.register(self._settle_at_exit)  # until finish, stop or abandon closes the run
        spawn_t = read_env(Env.SPAWN_T, float, t_init)
        self.sink.emit(E.WorkerReady(attempt=settings.attempt, init_s=round(time.time() - spawn_t, 4)))

    def _make_groups(self) -> ProcessGroup | None:
        """gpufleet's own groups; returns the checkpoint engine's. A separate gloo group, so background
        checkpoint collectives never interleave with training's."""
        ckpt_pg = dist.new_group(backend="gloo") if self.world_size > 1 else None
        # The per-step control all-reduce is a CPU tensor. gpufleet's own group carries those (gloo,
        # or cpu:gloo,cuda:nccl); a NCCL-only group the script made itself before init() cannot.
        self._ctl_pg = None
        if self.world_size > 1 and not carries_cpu(str(dist.get_backend())):
            self._ctl_pg = dist.new_group(backend="gloo")
        return ckpt_pg

    # ------------------------------------------------------------------ rounds in place
    def _survivable(self, exc: BaseException) -> bool:
        return self._recovery.survivable(exc, self._ddp)

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
        ckpt_pg = self._make_groups()
        self._ckpt.rebind(settings, rank=self.rank, world_size=self.world_size, sink=self.sink, group=ckpt_pg)
        self._faults = FaultInjector(
            faults_from_env(settings.faults), self.rank, self.sink.emit, settle=self._ckpt.settle
        )
        self._skips = [list(w) for w in settings.rollback.skip]
        spawn_t = read_env(Env.SPAWN_T, float, t0)
        init_s = round(time.time() - spawn_t, 4)
        self.sink.emit(E.WorkerReady(attempt=settings.attempt, init_s=init_s, hot_spare=hot_spare))

    def _promote(self) -> None:
        """A hot spare: wait for the order that makes it a rank, then join the round. Its model and
        optimizer were built meanwhile; restore() then loads their state."""
        preloader = self._recovery.await_promotion(self.settings, self._preload)
        self._reform(hot_spare=True)
        self._recovery.promoted(preloader, self.settings.rollback.max_step, self._ckpt)

    def _preload(self, step: int) -> Held | None:
        """A hot spare's verified load of commit ``step`` into its objects, on its own (it has no group
        yet): what it holds at its promotion (train/held.py), or None when there is nothing to load."""
        reader = self._recovery.preload_reader(self.settings, self.world_size, step)
        if reader is None:
            return None
        result = self._ckpt.load_primed(reader, step)
        if result is None:
            return None
        skips = self._apply_loaded(result.state_dict, int(result.step), result.meta, preload=True)
        return Held(
            step=int(result.step), path=result.path, source=result.source, meta=result.meta, skips=skips
        )

    def _rejoin_in_place(self) -> int:
        """A peer died during this step: discard the step, leave the broken round without a collective,
        rejoin the next one with the same objects and roll them back to the newest checkpoint (the
        memory tier first). Returns the step to resume at."""
        self._recovery.leave_round(self._ckpt, self.sink)
        self._reform()
        start = self._load_state()
        if self._ddp is not None:
            self._ddp.rejoin(self._restored_layout)
        self._save_due = False
        self._stall = 0.0
        return start

    # ------------------------------------------------------------------ restore
    def _on_stop_signal(self, signum: int, frame: object) -> None:
        self._stop_requested = True
        # One request is enough, and it can come twice: under Slurm the step's signal reaches every
        # process of the step and the node agent forwards it too. A duplicate must not kill the rank
        # while it checkpoints and exits (Python's finalization puts SIG_DFL back, but not SIG_IGN).
        _set_stop_handler(signal.SIG_IGN)

    def _internal_state(self) -> dict[str, Any]:
        return {"guard": self._guard.state_dict(), "skips": self._skips}

    def restore(self, state: dict[str, Any]) -> int:
        """Load the newest verified checkpoint into ``state``'s objects; return the step to resume at."""
        try:
            mapper = self._ckpt.mapper = StateMapper(state, self.rank)
        except ConfigError as e:  # the same script fails the same way after a restart
            if self.supervised:
                _exit_config_error(str(e))
            raise
        if self._recovery.spare is not None:  # a hot spare: built; now wait to become a rank
            self._promote()
            mapper.rank = self.rank
        if self.supervised and self.world_size > 1 and mapper.model is not None:
            mapper.model.register_forward_hook(self._after_forward)
        for opt in mapper.optimizers:
            opt.register_step_pre_hook(self._before_optimizer_step)
            opt.register_step_post_hook(self._after_optimizer_step)
        self._load_state()
        if not self.supervised and self.is_main:  # no supervisor to say what the run directory held
            if self._restored_from is None:
                _say(f"starting fresh in {self.run_dir}")
            else:
                _say(f"resuming {self.run_dir} from step {self._start} (checkpoint {self._restored_from})")
        if (self.world_size >= 3 or self._recovery.in_place) and mapper.model is not None:
            from gpufleet.train.exactddp import DDPWatcher

            tolerate = self._survivable if self._recovery.in_place else None
            self._ddp = DDPWatcher(mapper.model, saved=self._restored_layout, tolerate=tolerate)
        return self._start

    def _load_state(self) -> int:
        """Load the newest verified checkpoint into the restore dict's objects (those of a fresh start,
        or a survivor's own, rolled back in place); sets the step to resume at."""
        engine = self._ckpt.ensure_engine()
        max_step = self.settings.rollback.max_step
        t0 = time.monotonic()
        if self._recovery.in_place and self._restore_held(max_step, t0):
            return self._start
        result = self._ckpt.load_primed(engine, max_step)
        self._restored_layout = None
        self._restored_from = None if result is None else result.path
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

    def _restore_held(self, max_step: int | None, t0: float) -> bool:
        """In place: restore from what every rank of the round already holds; False: the round loads
        from storage. A collective: every rank of the round calls it."""
        held = self._recovery.restore_held(
            self._ckpt, max_step=max_step, group=self._ctl_pg, sink=self.sink, apply=self._apply_loaded
        )
        if held is None:
            return False
        self._skips = self._skips or held.skips
        self.sink.emit(
            E.Restore(
                step=held.step,
                fresh=False,
                path=held.path,
                source=held.source,
                load_s=round(time.monotonic() - t0, 4),
                preloaded=True,
            )
        )
        self._resume_at(held.step)
        return True

    def _resume_at(self, step: int) -> None:
        self._start = self.step = step
        self._ckpt.resume_at(step)

    def _apply_loaded(
        self, sd: dict[str, Any], step: int, meta: dict[str, Any], *, preload: bool = False
    ) -> list[list[int]]:
        """Put a loaded state dict (of commit ``step``) into the objects; returns its skip windows.
        ``preload``: a spare's, on its preload thread: an error is the preload's, not the process's."""
        assert self._ckpt.mapper is not None
        try:
            self._ckpt.mapper.check_world_size(meta.get("world_size"), self.world_size)
            self._ckpt.mapper.apply(sd, step=step)
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

    # ------------------------------------------------------------------ hooks on the script's objects
    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        # The staging copy overlapped forward/backward; parameters change now, so it must be done.
        self._stall += self._ckpt.wait_staged()
        if self._recovery.in_place and self._recovery.round_error(self._ddp) is not None:
            self._recovery.set_aside(optimizer)  # a discarded step: its update would be rolled back

    def _after_optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        self._recovery.put_back()
        self._progressed = True
        if self._ddp is not None:
            self._ddp.stop_watching()

    def _after_forward(self, *args: Any) -> None:
        # The first forward of the step (gradient accumulation runs several): data loading and forward
        # happen before DDP's gradient all-reduce, so a slow rank shows here even under DDP.
        if self._fwd_s is None:
            self._fwd_s = time.monotonic() - self._step_t0 - self._stall

    def _save(self, step: int, *, force: bool = False) -> None:
        meta: dict[str, Any] = {
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
        started, stall = self._ckpt.save(step, meta, force=force, fault=kind)
        self._stall += stall
        if started and fault is not None:
            self._faults.fired(fault, step)

    # ------------------------------------------------------------------ the step loop
    def _control(self, loss: float | None) -> float | None:
        """All-reduce [loss, non-finite, stop, save-due] once per step; returns the mean loss."""
        due = self._ckpt.due(self.step + 1)
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
            if self._recovery.errored is None:
                try:
                    dist.all_reduce(vec, group=self._ctl_pg)
                except Exception as e:  # noqa: BLE001 - a dead peer's error in any form; others re-raise
                    if not self._survivable(e):
                        raise
                    self._recovery.note_error(e)  # the step is discarded at its end; this rank's values stand
            if self._recovery.errored is not None:
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

        assert self._ckpt.mapper is not None
        for obj in self._ckpt.mapper.state.values():
            if isinstance(obj, ResumableLoader):
                for _ in range(n):
                    next(obj)

    def steps(self, total: int, *, steps_per_epoch: int | None = None) -> Iterator[int]:
        """Yield global step numbers from the restored step to ``total`` (exclusive)."""
        if self._ckpt.mapper is None:
            raise ConfigError("call run.restore(state) before run.steps()")
        if total < 0 or (steps_per_epoch is not None and steps_per_epoch <= 0):
            raise ConfigError("total must be >= 0 and steps_per_epoch > 0")
        self.steps_per_epoch = steps_per_epoch
        step = self._start
        if step >= total and self._restored_from is not None and self.is_main:
            # The loop would do nothing without a word (`gpufleet run` refuses the same command on a
            # finished run directory before it starts a worker; another command gets here).
            way_out = "--run-dir, or --fresh" if self.supervised else "GPUFLEET_RUN_DIR or init(run_dir=...)"
            _say(
                f"{self.run_dir} finished at step {step}; nothing to train for steps({total}): "
                f"use a new {way_out}"
            )
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
            if self._save_due and step > self._ckpt.last_saved_step:
                try:
                    self._save(step)
                except Exception as e:
                    if not self._survivable(e):
                        raise
                    self._recovery.note_error(e)
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
            if self._recovery.in_place and self._recovery.round_error(self._ddp) is not None:
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
        decision = self._ckpt.observe(step_s=dt - self._stall)
        if decision:
            self.sink.emit(E.Interval(step=step, **decision))

    def log(self, **metrics: Any) -> float | None:
        """Record metrics; the loss passes the spike/NaN guard, agreed across ranks. Returns the mean loss."""
        loss = metrics.get("loss")
        if loss is None:
            return None
        value = float(loss.detach().item() if isinstance(loss, torch.Tensor) else loss)
        value = self._faults.loss(self.step, value)
        if self._ckpt.mapper is not None and not self._ckpt.mapper.optimizers:
            self._progressed = True
        mean = self._control(value)
        assert mean is not None
        if self._recovery.errored is not None:
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
        self._ckpt.settle(timeout=60.0)  # a failure: the rollback uses an older checkpoint
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(ExitCode.WORKER_SPIKE)

    def _stop(self, step: int) -> None:
        """Stop requested (SIGUSR1 from the supervisor or Slurm): final checkpoint, then exit 0."""
        self._heartbeat_phase("finish")
        if step > self._ckpt.last_saved_step:
            self._save(step, force=True)
        self._ckpt.wait()
        self._close("interrupted")
        sys.exit(0)

    def finish(self) -> None:
        """Take the final checkpoint, wait for it to persist, and close the run."""
        if self._finished:
            return
        self._heartbeat_phase("finish")
        if self._ckpt.mapper is not None and self.step > self._ckpt.last_saved_step:
            self._save(self.step, force=True)
        self._ckpt.wait()
        self._close("completed")

    def abandon(self, wait_s: float) -> None:
        """Give this run up after a peer died (the in-process restart harness), with no collective: the
        in-flight checkpoint gets ``wait_s`` seconds to notice the dead peer and stop; SIGUSR1 gets its
        default handler back. The process group is the harness's to destroy."""
        self._finished = True
        atexit.unregister(self._settle_at_exit)
        self._ckpt.release(wait_s)
        _set_stop_handler(signal.SIG_DFL)

    def _settle_at_exit(self) -> None:
        """A script that ends without :meth:`finish` (or by an exception) still lets its save in flight
        commit: the persist thread is a daemon, and one that is inside torch's C++ code when the
        interpreter finalizes is ended there, which aborts the process (``terminate called without an
        active exception``) and loses that save."""
        if not self._finished:
            self._ckpt.release(_EXIT_SAVE_WAIT_S)

    def _heartbeat_phase(self, phase: str) -> None:
        # Tells the supervisor's hang detector that a long, step-less phase (final save) is starting.
        if self.supervised:
            self.sink.emit(E.Heartbeat(step=self.step, phase=E.HeartbeatPhase(phase)))

    def _close(self, status: str) -> None:
        self._finished = True
        atexit.unregister(self._settle_at_exit)
        _set_stop_handler(signal.SIG_IGN)  # the run is over: a late stop request is moot
        self._ckpt.close()
        if not self.supervised and self.is_main:
            self.sink.emit(E.RunEnd(status=E.RunStatus(status), exit_code=0))
        if self.world_size > 1 and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


_CURRENT: Run | None = None
_EXIT_SAVE_WAIT_S = 60.0
"""How long a script that ends without :meth:`Run.finish` waits at exit for its save in flight."""


def _say(line: str) -> None:
    print(f"gpufleet: {line}", file=sys.stderr, flush=True)


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


def init(**kwargs: Any) -> Run:
    """Create the :class:`Run` for this process (see :class:`gpufleet.core.settings.RunSettings` options).

    A setting that fails validation raises :class:`ConfigError`; under ``gpufleet run`` the worker
    instead prints it as one line and exits with ``ExitCode.WORKER_CONFIG``, which ends the run with
    exit code 2 (a restart would fail the same way).
    """
    try:
        settings = RunSettings.load(**kwargs)
    except ConfigError as e:
        if Env.CONTROL_FD.raw():
            _exit_config_error(str(e))
        raise
    run = Run(settings, kwargs)
    if run.supervised:
        # As a standby does after its imports (train/standby.py): what the imports left (torch: some
        # 300,000 objects) lives as long as the process; out of the collector's sight, its full
        # collections and the interpreter's exit skip it (exit: 1.5-1.9 s less on 2 loaded cores).
        gc.freeze()
    return run


def _exit_config_error(message: str) -> NoReturn:
    """Under a supervisor: the message to the supervisor (which prints it once), then exit 78 (no restart)."""
    rank = Platform.RANK.raw() or "0"  # raw: this path reports bad settings and must not raise
    # A control line like the heartbeat, read by the supervisor's monitor and never written to the
    # ledger (the settings that would name the run are what failed). Short enough for one atomic write.
    line = {"ev": "config_error", "t": time.time(), "rank": int(rank) if rank.isdigit() else 0}
    line["message"] = message[:1000]
    try:
        os.write(int(Env.CONTROL_FD.raw() or ""), (json.dumps(line) + "\n").encode())
    except (ValueError, OSError):
        print(f"gpufleet: error: {message}", file=sys.stderr, flush=True)  # no usable channel
    sys.stdout.flush()
    os._exit(ExitCode.WORKER_CONFIG)

"""The supervisor: run N workers, detect crashes, hangs and loss spikes, and restart from the
newest verified checkpoint until the job completes or a breaker trips.

Lifecycle per attempt: start (or promote standbys) -> monitor -> on failure: teardown, decide,
restart. Every decision is a ledger event; ``gpufleet report`` derives MTBF/MTTR/goodput from them.
"""

from __future__ import annotations

import functools
import os
import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpufleet.backends import Attempt, Blame, LaunchSpec, get_backend
from gpufleet.core import events as E
from gpufleet.core.env import Platform
from gpufleet.core.errors import UsageError
from gpufleet.core.exitcodes import ExitCode
from gpufleet.core.ledger import Ledger
from gpufleet.core.ports import free_port
from gpufleet.core.settings import Env
from gpufleet.train.faults import faults_to_env
from gpufleet.train.monitor import AttemptMonitor
from gpufleet.train.rollback import RollbackPlanner
from gpufleet.train.rundir import finished, nothing_to_train
from gpufleet.train.settings import SupervisorConfig

__all__ = ["SupervisorConfig", "Supervisor", "Outcome"]

_EXIT_POLL_S = 0.002  # how often to poll a worker whose channel just closed (see Supervisor._watch)
_EXIT_WINDOW_S = 0.2  # for how long after the channel closed


@dataclass
class Outcome:
    status: E.RunStatus
    exit_code: int
    restarts: int
    run_dir: str
    detail: str = ""  # config_error: the worker's message


@dataclass
class _Failure:
    cause: E.FailureCause
    rank: int
    exit_code: int | None = None
    signal: int | None = None
    happened_t: float | None = None
    detail: str = ""
    node: str | None = None  # multi-node backends: the node whose agent failed


@dataclass
class _ConfigError:
    """A rank's ``gpufleet.init()`` rejected its settings: a restart would fail the same way."""

    rank: int
    message: str


class Supervisor:
    def __init__(self, config: SupervisorConfig) -> None:
        self.cfg = config
        self.run_dir = Path(config.run_dir)
        # The same command again on a run directory whose last session completed would restore the
        # final checkpoint and train nothing: refuse it before any backend or worker exists. Another
        # command may ask for more steps (which only the script knows) and resumes, as a crashed or
        # stopped run does; its rank 0 says so if it has nothing to train (Run.steps).
        done = finished(self.run_dir)
        if done is not None and done.command == tuple(config.command):
            raise UsageError(nothing_to_train(done))
        self.session = uuid.uuid4().hex[:12]
        self.backend = get_backend(config.backend, standby=config.standby, **config.backend_kwargs())
        self._stop_signals = 0
        self.faults = list(config.faults)
        self.rollback = RollbackPlanner(self.run_dir, window=config.worker.spike_window)
        self._last_in_process_step: int | None = None  # the failure step of the last in-process restart
        self._in_process_attempt: int | None = None  # the attempt that in-process restart began

    # ------------------------------------------------------------------ public
    def run(self) -> Outcome:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        ledger = Ledger(self.run_dir, session=self.session)
        # SIGUSR1 too: Slurm's --signal=B:USR1@T asks for a final checkpoint before the time limit.
        stops = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
        old = {s: signal.signal(s, self._on_signal) for s in stops}
        view = None
        if self.cfg.progress:
            from gpufleet.train.progress import LiveView

            view = LiveView(log_dir=str(self.run_dir / "logs"))
        try:
            ledger.emit(
                E.RunStart(
                    world_size=self.cfg.nproc,
                    nproc=self.cfg.nproc,
                    backend=self.cfg.backend,
                    command=tuple(self.cfg.command),
                    config=self.cfg.public(),
                )
            )
            outcome = self._loop(ledger, view)
            ledger.emit(
                E.RunEnd(status=outcome.status, exit_code=int(outcome.exit_code), restarts=outcome.restarts)
            )
            return outcome
        finally:
            if view is not None:
                view.close()
            self.backend.close()
            for s, h in old.items():
                signal.signal(s, h)
            ledger.close()

    # ------------------------------------------------------------------ internals
    def _on_signal(self, signum: int, frame: object) -> None:
        self._stop_signals += 1

    def _spec(self, attempt: int) -> LaunchSpec:
        env = {
            **self.cfg.worker_env(),  # the worker settings set by flags (validated with the config)
            Env.RUN_DIR: str(self.run_dir.resolve()),
            Env.SESSION: self.session,
            Env.FAULTS: faults_to_env(self.faults),
            Env.ROLLBACK: self.rollback.pending().to_env(),
        }
        from gpufleet.backends.environ import launch_environ

        forward = launch_environ(self.cfg.env, inherit=self.backend.inherits_environment)
        if self.cfg.auto_telemetry:  # the ranks' sitecustomize hooks optimizer.step (train/autostep.py)
            from gpufleet.train.autostep import AUTOSTART_DIR

            path = forward.get(Platform.PYTHONPATH) or Platform.PYTHONPATH.get()  # --env's, else the shell's
            env[Platform.PYTHONPATH] = os.pathsep.join([AUTOSTART_DIR, *([path] if path else [])])
            env[Env.AUTO_TELEMETRY] = Env.AUTO_TELEMETRY.format(True)
        # With the live view on, worker output would tear it apart: send it to per-rank log files.
        log_dir = str(self.run_dir / "logs") if self.cfg.progress else None
        return LaunchSpec(
            command=self.cfg.command,
            nproc_per_node=self.cfg.nproc,
            env=env,
            # --master-addr/--master-port (or --rdzv-endpoint); a multi-node backend sets its own
            master_addr=self.cfg.master_addr or LaunchSpec.master_addr,
            master_port=self.cfg.master_port or free_port(),
            attempt=attempt,
            log_dir=log_dir,
            cpu_affinity=self.cfg.cpu_affinity,
            max_restarts=self.cfg.max_restarts,
            run_id=self.cfg.rdzv_id or self.session,
            forward=forward,
        )

    def _loop(self, ledger: Ledger, view: Any) -> Outcome:
        restarts = 0
        restart_steps: list[int] = []  # the failure step of every restart, for the restart rate
        no_progress = 0
        best_committed = -1
        progress_mark = -1
        attempt = 0
        carried: Attempt | None = None  # the next attempt, already formed by an in-process restart

        def outcome(status: E.RunStatus, code: ExitCode, detail: str = "") -> Outcome:
            return Outcome(status, code, restarts, str(self.run_dir), detail)

        while True:
            if carried is not None:
                run, carried = carried, None
            else:
                spec = self._spec(attempt)
                if attempt:
                    # Standbys, unless the last attempt's are still there: made now, they are promoted at
                    # once, so they import at normal priority.
                    self.backend.prepare(spec, eager=True)
                run = self.backend.start(spec)  # a multi-node backend sets run.spec.nnodes for this attempt
                if not attempt and self.cfg.in_process_restart:
                    # In-process restart's hot spares build beside the first workers, at normal priority:
                    # the mode that asks for the fastest recovery pays for it from the start. Plain
                    # standbys wait for the first checkpoint (_watch).
                    self.backend.prepare(run.spec, eager=True)
            ledger.emit(
                E.AttemptStart(
                    attempt=attempt,
                    world_size=run.spec.world_size,
                    pids=tuple(w.pid for w in run.workers if w.pid is not None),
                    nodes=tuple(w.node for w in run.workers if w.node),
                )
            )
            mon = AttemptMonitor(run, ledger, attempt, self.cfg.hang_timeout_floor, self.cfg.init_timeout)
            try:
                result = self._watch(run, mon, view, restarts)
            except BaseException:
                run.close()
                raise
            best_committed = max(best_committed, mon.committed_step)
            if isinstance(result, E.RunStatus):  # completed / interrupted
                run.close()
                return outcome(result, ExitCode.OK)
            if isinstance(result, _ConfigError):  # a restart would fail the same way: end the run, exit 2
                run.stop(self.cfg.grace_s)
                run.close()
                ledger.emit(E.GiveUp(reason=f"configuration error: {result.message}"))
                return outcome(E.RunStatus.CONFIG_ERROR, ExitCode.USAGE, result.message)
            failure = result
            ledger.emit(
                E.Failure(
                    cause=failure.cause,
                    rank=failure.rank,
                    exit_code=failure.exit_code,
                    signal=failure.signal,
                    step=mon.step,
                    happened_t=failure.happened_t,
                    detail=failure.detail,
                    attempt=attempt,
                    node=failure.node,
                )
            )
            detect_s = max(0.0, time.time() - (failure.happened_t or time.time()))
            ledger.emit(E.Detected(cause=failure.cause, attempt=attempt, detect_s=round(detect_s, 4)))
            # In-process restart keeps the survivors running: only the lost rank is stopped (if alive).
            fallback = self._in_process_unsafe(failure, mon, run) if self.cfg.in_process_restart else None
            in_process = self.cfg.in_process_restart and fallback is None
            t0 = time.monotonic()
            if not in_process:
                run.stop(self.cfg.grace_s)
            ledger.emit(E.Teardown(attempt=attempt, teardown_s=round(time.monotonic() - t0, 4)))
            self._drop_fired(mon.fired)
            # Multi-node backends: find lost nodes, isolate them, and say whether enough remain.
            verdict = self.backend.after_failure(run, ledger, blame=Blame(failure.rank, failure.cause))
            why_end = None
            status, code = E.RunStatus.NODES_LOST, ExitCode.FAILED
            if not verdict.restart:
                why_end = verdict.reason
            elif self._stop_signals:
                # Asked to stop (SIGTERM, or Slurm's time-limit USR1) while no attempt was running:
                # the newest checkpoint is all there is to keep. A new attempt would only be signalled
                # again while its ranks start up, before they can take a final checkpoint.
                run.stop(self.cfg.grace_s)
                run.close()
                return outcome(E.RunStatus.INTERRUPTED, ExitCode.OK)
            if view is not None:
                view.failure(failure.cause, failure.rank, mon.step)
            # Breakers, in order of specificity.
            if why_end is None and failure.cause == E.FailureCause.SPIKE:
                self.rollback.plan(
                    mon.spike_step if mon.spike_step is not None else mon.step, ledger, attempt
                )
                why_end = self.rollback.over_budget(self.cfg.max_rollbacks, self.cfg.rollback_window)
                status, code = E.RunStatus.MAX_ROLLBACKS, ExitCode.MAX_ROLLBACKS
            elif why_end is None:
                self.rollback.clear_pending()
            if why_end is None:
                if best_committed > progress_mark:
                    progress_mark, no_progress = best_committed, 0
                else:
                    no_progress += 1
                if self.cfg.max_no_progress and no_progress >= self.cfg.max_no_progress:
                    why_end = f"{no_progress} consecutive restarts made no checkpoint progress"
                    status, code = E.RunStatus.NO_PROGRESS, ExitCode.NO_PROGRESS
            if why_end is None:
                cfg = self.cfg
                why_end = restart_budget_spent(restart_steps, mon.step, cfg.max_restarts, cfg.restart_window)
                status, code = E.RunStatus.MAX_RESTARTS, ExitCode.MAX_RESTARTS
            if why_end is not None:
                run.stop(self.cfg.grace_s)  # the survivors an in-process restart would have kept
                run.close()
                ledger.emit(E.GiveUp(reason=why_end))
                return outcome(status, code)
            restart_steps.append(mon.step)
            restarts += 1
            attempt += 1
            if in_process:
                carried = self.backend.replace(
                    run, {failure.rank}, self._spec(attempt), rejoined=functools.partial(self._rejoins, mon)
                )
                if carried is None:
                    fallback = f"the {self.backend.name} backend could not keep the survivors"
                    run.stop(self.cfg.grace_s)
                else:
                    self._last_in_process_step = self._failed_at(failure, mon)
                    self._in_process_attempt = attempt
            run.close()  # after a handover: only what the next attempt did not take
            path = E.RestartPath.IN_PROCESS if carried is not None else E.RestartPath.FULL
            ledger.emit(E.Restart(attempt=attempt, reason=failure.cause.value, path=path, fallback=fallback))

    def _rejoins(self, mon: AttemptMonitor, ranks: list[int]) -> bool | None:
        """Wait for these survivors' ``rejoin`` events (they follow the lost rank's death within a
        collective's error): True when every one stays in place, False when one runs its script again,
        None when one has not come within the hang timeout (it is stuck: restart the whole attempt)."""
        deadline = time.monotonic() + self.cfg.hang_timeout_floor
        while any(r not in mon.rejoined for r in ranks):
            left = deadline - time.monotonic()
            if left <= 0 or any(code is not None for r, code in mon.run.poll().items() if r in ranks):
                return None
            mon.pump(min(left, 0.002))
        return all(mon.rejoined[r] for r in ranks)

    @staticmethod
    def _failed_at(failure: _Failure, mon: AttemptMonitor) -> int:
        """Where the failed rank was: the step of its last heartbeat (rank 0's progress, which the
        other ranks' events may or may not have reached, is a noisier mark)."""
        return mon.hb_step.get(failure.rank, mon.step)

    def _in_process_unsafe(self, failure: _Failure, mon: AttemptMonitor, run: Attempt) -> str | None:
        """Why this failure must be recovered by a full restart although in-process restart is on; None
        when the survivors may keep their processes."""
        if failure.cause == E.FailureCause.SPIKE:
            return "a loss spike rolls every rank back through a full restart"
        if len(run.workers) < 2:
            return "a single rank has no survivors to keep"
        at = self._failed_at(failure, mon)
        if self._last_in_process_step == at:
            return f"a second failure at step {at} after an in-process restart there"
        # The failing step comes from heartbeats, which lag under load; so a failure in the attempt
        # an in-process restart began, before that attempt committed any checkpoint, counts as the
        # same failure again (no durable progress past it).
        if mon.attempt == self._in_process_attempt and mon.committed_step < 0:
            return f"a second failure at step {at} after an in-process restart, before any new checkpoint"
        codes = run.poll()
        gone = [w.rank for w in run.workers if w.rank != failure.rank and codes.get(w.rank) is not None]
        if gone:
            return f"rank(s) {', '.join(map(str, gone))} exited too"
        return None

    @staticmethod
    def _last_words(mon: AttemptMonitor, run: Attempt, rank: int, limit_s: float = 0.05) -> None:
        """Read what a worker that exited sent last (inject / rollback events): until its channel is at
        end of file, at most ``limit_s``. Waiting the whole bound every time cost every recovery 50 ms."""
        deadline = time.monotonic() + limit_s
        while True:
            mon.pump(0)
            left = deadline - time.monotonic()
            if run.events.closed(rank) or left <= 0:
                return
            mon.pump(min(left, 0.005))

    def _drop_fired(self, fired: list[E.Inject]) -> None:
        done = {f.fault_id for f in fired if not f.persist}
        self.faults = [f for f in self.faults if f.id not in done]

    def _watch(
        self, run: Attempt, mon: AttemptMonitor, view: Any, restarts: int
    ) -> E.RunStatus | _Failure | _ConfigError:
        standby_ready = False
        stopping_since: float | None = None
        exiting: dict[int, float] = {}  # rank -> when its channel closed while its process still ran
        while True:
            # A worker's channel closes as it dies, an instant before its exit status can be read: poll
            # again within milliseconds, not a whole poll interval, for a moment after a channel closes.
            soon = any(time.monotonic() - t < _EXIT_WINDOW_S for t in exiting.values())
            mon.pump(_EXIT_POLL_S if soon else self.cfg.poll_s)
            if view is not None:
                view.update(mon, restarts)
            recovering = restarts > 0 and not mon.step_times
            # The first attempt's standbys wait for its first checkpoint: before it, a restart repeats
            # the run from its first step, and a short job that ends first never pays their imports
            # (two `import torch` on a 2-core host: about 2x a 60-step job's wall time).
            # Nor for the final checkpoint (``run.finish``): the run is ending.
            ending = any(p in (E.HeartbeatPhase.FINISH, E.HeartbeatPhase.EXIT) for p in mon.phase.values())
            due = restarts > 0 or (mon.committed_step >= 0 and not ending)
            if not standby_ready and due and len(mon.ready) == len(mon.expected_ranks) and not recovering:
                # Warm the next attempt's interpreters, but never while this attempt is recovering
                # (restore and first step are part of MTTR): their `import torch` would compete with it
                # for CPU. The first attempt's at normal priority, so that they are ready within
                # seconds of the first commit; a restarted attempt's replacements at idle priority.
                self.backend.prepare(run.spec, eager=not restarts)
                standby_ready = True
            codes = run.poll()
            for w in run.workers:
                if codes[w.rank] is None and w.rank not in exiting and run.events.closed(w.rank):
                    exiting[w.rank] = time.monotonic()
            if self._stop_signals and stopping_since is None:
                stopping_since = time.monotonic()
                run.request_final_checkpoint()  # at the next step boundary
            if all(c is not None for c in codes.values()):
                mon.pump(0)  # drain the last events
                if stopping_since is not None:
                    return E.RunStatus.INTERRUPTED
                if all(c == 0 for c in codes.values()):
                    return E.RunStatus.COMPLETED
            if stopping_since is not None:
                if self._stop_signals > 1 or time.monotonic() - stopping_since > self.cfg.final_grace_s:
                    run.stop(self.cfg.grace_s)
                    return E.RunStatus.INTERRUPTED
                continue
            for w in run.workers:
                c = codes[w.rank]
                if c is None or c == 0:
                    continue
                self._last_words(mon, run, w.rank)
                if c == ExitCode.WORKER_CONFIG:  # gpufleet.init() rejected its settings: terminal
                    return _ConfigError(
                        w.rank, mon.config_error or f"rank {w.rank} rejected its settings (see its stderr)"
                    )
                if c == ExitCode.WORKER_SPIKE:
                    return _Failure(
                        E.FailureCause.SPIKE,
                        w.rank,
                        exit_code=c,
                        happened_t=mon.spike_t or time.time(),
                        detail="loss spike or NaN",
                        node=w.node,
                    )
                sig = -c if c < 0 else None
                return _Failure(
                    E.FailureCause.CRASH,
                    w.rank,
                    exit_code=None if sig else c,
                    signal=sig,
                    happened_t=mon.injected_at(w.rank, "kill") or time.time(),
                    detail=f"killed by signal {sig}" if sig else f"exit code {c}",
                    node=w.node,
                )
            if self.cfg.straggler_action == "restart" and mon.straggler is not None:
                s = mon.straggler
                assert s.rank is not None
                return _Failure(
                    E.FailureCause.STRAGGLER,
                    s.rank,
                    happened_t=s.t,
                    detail=f"straggler: {s.section} {s.seconds:.3g} s per step against {s.peers_s:.3g} s "
                    f"({s.ratio:.2f}x) for {s.windows} windows",
                    node=s.node,
                )
            hung = mon.hung_rank(codes)
            if hung is not None:
                rank, last_wall = hung
                return _Failure(
                    E.FailureCause.HANG,
                    rank,
                    happened_t=last_wall,
                    detail=f"no heartbeat for {time.time() - last_wall:.1f}s at step {mon.step}",
                )


def restart_budget_spent(restart_steps: list[int], step: int, max_restarts: int, window: int) -> str | None:
    """Why a failure at ``step`` may not be restarted, or None.

    The budget is a rate, like the rollback budget: at most ``max_restarts`` restarts whose failure
    step lies within ``window`` steps of this one (0: the whole run). A crash loop fails at the same
    step again and again and uses the budget up; a long run that keeps making progress between
    failures (a node lost every few hours) never does.
    """
    recent = sum(1 for s in restart_steps if window == 0 or abs(step - s) < window)
    if recent < max_restarts:
        return None
    where = "in this run" if window == 0 else f"within {window} steps of step {step}"
    return f"restart budget of {max_restarts} used up ({recent} restarts {where})"

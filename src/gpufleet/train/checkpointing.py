"""A Run's checkpoints: the engine, the interval policy, and the script's state in and out of them.

:class:`Checkpointer` is the one object :class:`~gpufleet.train.run.Run` asks to save, load and wait.
It makes the :class:`~gpufleet.checkpoint.engine.CheckpointEngine` on first use (a rank that never
saves never imports it), with the run's settings and its own gloo group, and takes over the staging
buffers of the previous round's engine after an in-place rejoin. It keeps the interval policy (fixed,
or ``auto`` from the observed stall and persist times and the run directory's MTBF) and the
:class:`~gpufleet.train.statedict.StateMapper` that turns the restore dict's objects into a state dict
and back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpufleet.core import events as E
from gpufleet.core.errors import CheckpointError
from gpufleet.core.ledger import EventSink, read_events
from gpufleet.core.settings import RunSettings

if TYPE_CHECKING:  # imported where first used: not in a rank that never saves
    from torch.distributed import ProcessGroup

    from gpufleet.checkpoint import CheckpointEngine, LoadResult
    from gpufleet.checkpoint.snapshot import Snapshot
    from gpufleet.reliability.interval import IntervalPolicy
    from gpufleet.train.statedict import StateMapper

__all__ = ["Checkpointer"]


class Checkpointer:
    """The checkpoint side of one rank's run: engine, interval policy and state mapping.

    ``internal_state``: the run's own state saved with every checkpoint (under ``_gpufleet``: the
    spike guard's history and the skip windows)."""

    def __init__(
        self,
        settings: RunSettings,
        *,
        rank: int,
        world_size: int,
        sink: EventSink,
        group: ProcessGroup | None,
        keep_snapshot: bool,
        internal_state: Callable[[], dict[str, Any]],
    ) -> None:
        self.settings = settings
        self.rank = rank
        self.world_size = world_size
        self.sink = sink
        self.group = group  # a gloo group of its own: checkpoint collectives never meet training's
        self.keep_snapshot = keep_snapshot  # in place: a survivor rolls back from it (train/held.py)
        self._internal_state = internal_state
        self.mapper: StateMapper | None = None
        self.engine: CheckpointEngine | None = None
        self.policy: IntervalPolicy | None = None
        # The last round's engine (in place), or a promoted spare's reader: the next engine takes
        # over its staging buffers and snapshot.
        self.carry: CheckpointEngine | None = None
        self.last_saved_step = -1
        self._observed: dict[str, float] = {}  # latest stall/persist seconds, fed to the interval policy

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def rebind(
        self,
        settings: RunSettings,
        *,
        rank: int,
        world_size: int,
        sink: EventSink,
        group: ProcessGroup | None,
    ) -> None:
        """A new round (in place): its settings, rank, sink and group; the next engine is made for them."""
        self.settings = settings
        self.rank = rank
        self.world_size = world_size
        self.sink = sink
        self.group = group

    # ------------------------------------------------------------------ the engine
    def ensure_engine(self) -> CheckpointEngine:
        if self.engine is None:
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
                keep_snapshot=self.keep_snapshot,
            )
            self.engine = CheckpointEngine(
                cfg,
                rank=self.rank,
                world_size=self.world_size,
                process_group=self.group,
                sink=_ObservingSink(self.sink, self._observed),
                previous=self.carry,
            )
            if self.carry is not None:
                # The last round's engine goes on a thread: the teardown of its (already destroyed)
                # gloo groups joins their threads, 19 ms measured on a survivor's way back to training.
                old, self.carry = [self.carry], None
                threading.Thread(target=old.clear, name="gpufleet-release", daemon=True).start()
            mtbf, source = self._mtbf_estimate()
            self.policy = IntervalPolicy.parse(s.checkpoint_every, mtbf_s=mtbf, mtbf_source=source)
        return self.engine

    def _memory_budget(self) -> int:
        """The in-memory tier's budget. With ranks on several nodes (``LOCAL_WORLD_SIZE`` <
        ``WORLD_SIZE``) the engine replicates each node's part to a peer node's memory
        (checkpoint/storage/peer.py); on one node it keeps whole checkpoints
        (checkpoint/storage/memory.py)."""
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

        _, uptime, failures = mtbf(read_events(Path(self.settings.run_dir)))
        if failures == 0:
            return configured, "configured"
        if configured is None:
            return (uptime / failures if uptime > 0 else None), "history"
        return (uptime + configured) / (failures + 1), "history+configured"

    # ------------------------------------------------------------------ state in and out
    def state_dict(self) -> dict[str, Any]:
        """The restore dict's objects as one state dict, the run's own state under ``_gpufleet``."""
        assert self.mapper is not None
        sd = self.mapper.collect()
        sd["_gpufleet"] = self._internal_state()
        return sd

    def save(
        self, step: int, meta: dict[str, Any], *, force: bool = False, fault: str | None = None
    ) -> tuple[bool, float]:
        """Start a save of commit ``step`` (see ``CheckpointEngine.save``). Whether it started (False:
        skipped), and the seconds the engine's ``save`` held the training up."""
        assert self.mapper is not None
        engine = self.ensure_engine()
        sd = self.state_dict()
        deferred = self.mapper.deferred_keys() if self.settings.overlap_staging and not force else None
        t0 = time.monotonic()
        started = engine.save(step, sd, meta=meta, deferred=deferred, force=force, fault=fault)
        stall = time.monotonic() - t0
        if started:
            self.last_saved_step = step
            if self.is_main:
                assert self.policy is not None
                self.policy.saved(step, time.time())
        return started, stall

    def load_primed(self, engine: CheckpointEngine, max_step: int | None) -> LoadResult | None:
        """The newest verified commit at or below ``max_step`` loaded into the objects, or None.

        The load's template needs optimizer state: shaped from the checkpoint's metadata where it
        can be, else torch makes it with a fake step. It is made only once there is a checkpoint
        to load (a fresh start makes none), and an optimizer that had no state gets none back
        when nothing is loaded: a fresh run starts as the same script would without us (a fake
        AdamW step leaves step=1 behind and changes every later update)."""
        assert self.mapper is not None
        mapper = self.mapper
        stateless = [opt for opt in mapper.optimizers if not opt.state]

        def template() -> dict[str, Any]:
            mapper.prime_optimizers(engine.newest_metadata(max_step))
            return self.state_dict()

        try:
            result = engine.load(template, max_step=max_step, optional=mapper.rank_entries())
        except BaseException:
            mapper.unprime(stateless)
            raise
        if result is None:
            mapper.unprime(stateless)
        return result

    def snapshot(self, max_step: int | None) -> Snapshot | None:
        """The engine's in-process copy of its newest commit at or below ``max_step`` (in place)."""
        return self.ensure_engine().snapshot(max_step)

    # ------------------------------------------------------------------ the interval
    def resume_at(self, step: int) -> None:
        """The run resumes at ``step``: nothing after it is saved, and the interval counts from it."""
        self.last_saved_step = step
        assert self.policy is not None
        self.policy.reset(step, time.time())

    def due(self, step: int) -> bool:
        """Whether the policy wants a save before ``step`` (rank 0 decides; the control vector tells all)."""
        return self.is_main and self.policy is not None and self.policy.due(step, time.time())

    def observe(self, step_s: float) -> dict[str, Any] | None:
        """Feed one step's time (less its stall) and the latest checkpoint times to the policy; the
        policy's new decision (an ``interval`` event's fields), or None."""
        assert self.policy is not None
        obs = dict(self._observed)  # the observing sink holds this very dict: copy, then clear in place
        self._observed.clear()
        # A step overlapped a persist if one is still running or one committed during it: persist
        # and checksum threads take CPU from training, a cost the stall alone does not show.
        overlapped = "persist_s" in obs or (self.engine is not None and self.engine.persisting())
        return self.policy.observe(step_s=step_s, overlapped=overlapped, **obs)

    # ------------------------------------------------------------------ waiting
    def wait_staged(self) -> float:
        """Wait for the staging copy of the save in flight (parameters are about to change); seconds."""
        return 0.0 if self.engine is None else self.engine.wait_staged()

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the save in flight to commit; raises CheckpointError when it failed."""
        if self.engine is not None:
            self.engine.wait(timeout=timeout)

    def settle(self, timeout: float | None = None) -> None:
        """Let the save in flight commit or fail; a failure is in the ledger already (ckpt_failed)."""
        try:
            self.wait(timeout)
        except CheckpointError:
            pass

    def release(self, wait_s: float) -> None:
        """Leave a round whose peer died, with no collective: the save in flight gets ``wait_s``
        seconds to notice the dead peer and stop."""
        try:
            self.wait(wait_s)
        except Exception:  # noqa: BLE001 - a save that cannot commit without its peer: the ledger has it
            pass

    def leave_round(self, wait_s: float) -> None:
        """In place: :meth:`release`, then drop the engine (bound to the broken groups), keeping it
        as the next engine's carry when no save of it still runs (its buffers are nobody's now)."""
        if self.engine is None:
            return
        self.release(wait_s)
        if not self.engine.persisting():
            self.carry = self.engine
        self.engine = None

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


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

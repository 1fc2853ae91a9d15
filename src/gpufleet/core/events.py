"""Typed ledger events: one frozen dataclass per event kind, the registry, and parsing.

Every event carries the envelope of :class:`Event` (``t``, ``mono``, ``session``, ``rank``,
``attempt``) plus the fields of its kind. On disk an event is one JSON line (see
:mod:`gpufleet.core.ledger`)::

    {"ev":"step","v":1,"t":...,"mono":...,"session":"a1b2","rank":0,"attempt":0,"step":4,...}

``ev`` is the kind (``Event.kind``) and ``v`` the ledger format version (:data:`LEDGER_VERSION`);
a line without ``v`` is version 1. Optional fields whose value is ``None`` (or an empty tuple, where
that is the default) are left out of the line. Closed sets are :class:`enum.StrEnum`, so the JSON
holds their plain strings.

A kind is declared once, on its class (``@event("step") class Step(Event)``); the registry
(:data:`EVENT_TYPES`) and ``__all__`` follow from the declarations, and readers compare raw records
with the class's kind (``rec["ev"] == E.Step.kind``).

Writing is strict: constructing an event checks every field's type (a typo in a field name, a
missing field or a value outside an enum raises :class:`EventSchemaError`). Reading is lenient by
default, so an older reader survives a newer ledger: :func:`parse_event` ignores fields it does not
know, keeps an enum value it does not know as a plain string, and turns a line of an unknown kind,
or one whose fields do not fit, into an :class:`UnknownEvent` (which the reliability math skips).
``parse_event(rec, strict=True)`` raises instead. docs/ledger.md documents every kind; a unit test
keeps it and :data:`EVENT_TYPES` in step.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import time
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from gpufleet.core.errors import EventSchemaError

LEDGER_VERSION = 1
"""The format version written as ``v`` on every line. Bump it when a field changes meaning or is
removed; adding an optional field or a kind does not need a bump (old readers ignore both)."""


# ---------------------------------------------------------------------------------- closed sets
class FailureCause(enum.StrEnum):
    """Why an attempt failed (``failure.cause``)."""

    CRASH = "crash"  # a rank exited non-zero or was killed by a signal
    HANG = "hang"  # a rank stopped heartbeating
    SPIKE = "spike"  # the loss guard fired (spike or NaN; the ``spike`` event says which)
    STRAGGLER = "straggler"  # a persistent straggler, with --straggler-action restart (``straggler`` event)


class RunStatus(enum.StrEnum):
    """How a session ended (``run_end.status``)."""

    COMPLETED = "completed"
    INTERRUPTED = "interrupted"  # asked to stop (SIGTERM/SIGINT/SIGUSR1): final checkpoint taken
    NO_PROGRESS = "no_progress"  # restarts stopped committing newer checkpoints
    MAX_RESTARTS = "max_restarts"
    MAX_ROLLBACKS = "max_rollbacks"
    NODES_LOST = "nodes_lost"  # too few healthy nodes left (multi-node backends)
    CONFIG_ERROR = "config_error"  # a worker's gpufleet.init() rejected its settings (exit 2, no restart)


class RollbackMode(enum.StrEnum):
    """What a spike rollback does (``rollback.mode``)."""

    REPLAY = "replay"  # first spike at a step: restore and replay the same batches
    SKIP = "skip"  # recurring spike: roll back further and skip the batch window


class RestoreSource(enum.StrEnum):
    """Where a restored checkpoint came from."""

    MEMORY = "memory"  # this node's in-memory tier (docs/checkpoints.md, "Memory tier")
    PROCESS = "process"  # the rank's own copy of the commit, kept in its process (an in-place rollback)
    PEER_MEMORY = "peer_memory"  # another node's in-memory tier
    LOCAL = "local"
    S3 = "s3"


class RestartPath(enum.StrEnum):
    """How the supervisor recovered from a failure (``restart.path``)."""

    FULL = "full"  # every worker stopped; all ranks start again (standby interpreters where there are)
    IN_PROCESS = "in_process"  # survivors kept their process and rejoined; only the lost rank was replaced


class IntervalMode(enum.StrEnum):
    """The checkpoint interval policy (``interval.policy``)."""

    STEPS = "steps"
    TIME = "time"
    AUTO = "auto"


class HeartbeatPhase(enum.StrEnum):
    """A long phase without step heartbeats (``hb.phase``); absent means a normal step."""

    SYNC = "sync"  # waiting on peers in the per-step all-reduce
    FINISH = "finish"  # the final checkpoint
    EXIT = "exit"  # the script has returned; the interpreter is exiting (a script without gpufleet.init())


class TimingSection(enum.StrEnum):
    """A per-rank timing the straggler detector compares across ranks (``straggler.section``)."""

    FWD = "fwd"  # step start to the end of the model's forward: data loading and forward, no DDP collective
    WORK = "work"  # step start to the per-step control all-reduce, less the checkpoint stall


class NodeStateName(enum.StrEnum):
    """A node's state in the fleet ledger (see docs/health.md)."""

    HEALTHY = "healthy"
    SUSPECT = "suspect"
    DRAINED = "drained"
    REPAIRED = "repaired"
    VALIDATED = "validated"
    IN_SERVICE = "in_service"


class Component(enum.StrEnum):
    """The part of a node a state change blames."""

    GPU = "gpu"
    MEMORY = "memory"
    NETWORK = "network"
    STORAGE = "storage"
    HOST = "host"
    SOFTWARE = "software"
    UNKNOWN = "unknown"


class Actor(enum.StrEnum):
    """Who changed a node's state."""

    GPUFLEET = "gpufleet"
    ADMIN = "admin"


class Remedy(enum.StrEnum):
    """What a failed node needs: the action class of the XID/SXID behind it, least to most disruptive."""

    WATCH = "watch"
    DRAIN = "drain"
    RESET_GPU = "reset_gpu"
    REBOOT = "reboot"
    SERVICE_REQUIRED = "service_required"


class SlurmActionKind(enum.StrEnum):
    DRAIN = "drain"
    RESUME = "resume"


# ---------------------------------------------------------------------------------- base
@dataclass(frozen=True, kw_only=True, slots=True)
class Event:
    """The envelope every event carries. Each kind is a subclass declared with :func:`event`."""

    #: The ``ev`` string of the kind (set by :func:`event`).
    kind: ClassVar[str] = ""
    #: False for events that only travel from a worker to its supervisor and never reach the ledger.
    in_ledger: ClassVar[bool] = True
    #: Attribute -> ledger key, where the key cannot be an attribute name (``kind`` is the class's).
    json_names: ClassVar[Mapping[str, str]] = {}

    t: float = field(default_factory=time.time)
    """Wall clock, seconds since the epoch, when the thing happened or finished."""
    mono: float = field(default_factory=time.monotonic)
    """``time.monotonic()`` of the emitting process (comparable between processes on one host)."""
    session: str | None = None
    """One ``gpufleet run`` invocation (the ledger fills it in)."""
    rank: int | None = None
    """The rank the event comes from (worker events) or is about (``failure``)."""
    attempt: int | None = None
    """The attempt the event belongs to (the supervisor stamps it on relayed worker events)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super(Event, cls).__init_subclass__(**kwargs)  # the slotted class: no zero-argument super()
        if "kind" in vars(cls) or "in_ledger" in vars(cls):
            raise TypeError(f"{cls.__name__}: declare an event's kind with @event(...), not in its body")

    def __post_init__(self) -> None:
        for f in _schema(type(self)):
            value = _coerce(getattr(self, f.name), f.tp, True, f"{self.kind or type(self).__name__}.{f.json}")
            object.__setattr__(self, f.name, value)

    def to_record(self) -> dict[str, Any]:
        """The JSON object written to the ledger (see :func:`to_record`)."""
        return to_record(self)


EVENT_TYPES: dict[str, type[Event]] = {}
"""Every event kind by its ``ev`` string, in declaration order (filled by :func:`event`)."""

_E = TypeVar("_E", bound=Event)


@typing.dataclass_transform(kw_only_default=True, frozen_default=True, field_specifiers=(field,))
def event(kind: str, *, in_ledger: bool = True) -> Callable[[type[_E]], type[_E]]:
    """Declare an event kind: the decorated class becomes a frozen, keyword-only, slotted dataclass
    whose ``kind`` is ``kind``, registered in :data:`EVENT_TYPES`. ``in_ledger=False``: the event
    only travels from a worker to its supervisor.

    A decorator rather than a class keyword: ``slots=True`` makes a new class, and the registry must
    hold that one. A subclass that sets ``kind`` in its body instead is refused at import, so no kind
    escapes the registry."""

    def declare(cls: type[_E]) -> type[_E]:
        if kind in EVENT_TYPES:
            first = EVENT_TYPES[kind].__name__
            raise TypeError(f"event kind {kind!r} declared twice: {first}, {cls.__name__}")
        made = dataclass(frozen=True, kw_only=True, slots=True)(cls)
        made.kind, made.in_ledger = kind, in_ledger
        EVENT_TYPES[kind] = made
        return made

    return declare


# ---------------------------------------------------------------------------------- run lifecycle
@event("run_start")
class RunStart(Event):
    """A session starts (supervisor; rank 0 in a standalone run)."""

    world_size: int  # ranks in the first attempt
    backend: str  # launcher: local, srun, ... or "standalone" (no supervisor)
    nproc: int | None = None  # processes per node
    command: tuple[str, ...] = ()  # the training command line
    config: Mapping[str, Any] | None = None  # the supervisor's configuration


@event("run_end")
class RunEnd(Event):
    """A session ends; its wall time ends here (without it, at the session's last event)."""

    status: RunStatus  # how it ended
    exit_code: int  # the exit code of ``gpufleet run``
    restarts: int | None = None  # restarts in this session (supervisor)


@event("attempt_start")
class AttemptStart(Event):
    """Workers of an attempt spawned (or standby workers promoted). ``attempt`` is set."""

    world_size: int  # ranks in this attempt
    pids: tuple[int, ...] = ()  # worker (or node agent) process ids
    nodes: tuple[str, ...] = ()  # nodes of the attempt (multi-node backends)


@event("worker_ready")
class WorkerReady(Event):
    """A rank's process group is up (every rank). ``rank`` and ``attempt`` are set."""

    init_s: float  # spawn (or its order) -> process group up, seconds
    # A hot spare: the script had built this rank's objects before the failure (train/run.py)
    hot_spare: bool = False


@event("hb", in_ledger=False)
class Heartbeat(Event):
    """A worker is alive (worker -> supervisor pipe only; never written to the ledger)."""

    step: int  # the step the rank is at
    phase: HeartbeatPhase | None = None  # a step-less phase; None while stepping
    total: int | None = None  # the run's total steps (sent with step heartbeats)
    work: float | None = None  # ``sync`` heartbeats: this step's TimingSection.WORK seconds
    fwd: float | None = None  # ``sync`` heartbeats: this step's TimingSection.FWD seconds (if a forward ran)


# ---------------------------------------------------------------------------------- progress
@event("step")
class Step(Event):
    """One completed step (rank 0). Work = ``dt - stall``; it started at ``t - dt``."""

    step: int  # 0-based index of the step just finished
    dt: float  # its full wall duration, including the checkpoint stall inside it
    stall: float = 0.0  # the part of ``dt`` training was blocked by a checkpoint
    epoch: int = 0  # the epoch the step belongs to
    loss: float | None = None  # the mean loss over ranks, when ``run.log(loss=...)`` was called


@event("epoch_end")
class EpochEnd(Event):
    """The last step of an epoch completed (rank 0; needs ``run.steps(..., steps_per_epoch=N)``)."""

    epoch: int  # the epoch that ended (0-based)
    step: int  # the index of its last step


# ---------------------------------------------------------------------------------- failures
@event("failure")
class Failure(Event):
    """An attempt failed (supervisor). ``t`` is when it was detected; ``rank`` the failed rank."""

    cause: FailureCause  # what failed
    exit_code: int | None = None  # the rank's exit code (None when killed by a signal, or a hang)
    signal: int | None = None  # the signal that killed it
    step: int | None = None  # the newest step rank 0 reported
    happened_t: float | None = None  # when it happened (exit time; last heartbeat for a hang)
    detail: str = ""  # human-readable
    node: str | None = None  # multi-node backends: the node whose agent reported the failure


@event("detected")
class Detected(Event):
    """The supervisor noticed a failure (supervisor)."""

    cause: FailureCause  # as in the failure
    detect_s: float  # detected - happened, seconds


@event("teardown")
class Teardown(Event):
    """All workers of a failed attempt are gone (supervisor). ``t`` = teardown end."""

    teardown_s: float  # how long stopping the remaining workers took


@event("restart")
class Restart(Event):
    """A new attempt starts after a failure (supervisor). ``attempt`` is the new attempt."""

    reason: str  # the failure cause that made the restart necessary
    path: RestartPath = RestartPath.FULL  # how: every worker restarted, or only the lost one (in-process)
    fallback: str | None = None  # in-process restart was on but unsafe here: why the full path was taken


@event("rejoin")
class Rejoin(Event):
    """A surviving rank left its failed collective and waits to rejoin in-process (every such rank).

    ``t`` = ready to rejoin; ``attempt`` = the attempt it rejoins."""

    reason: str  # the collective's error, first line
    abort_s: float  # abandoning the round: engine wait, process groups destroyed, objects freed
    # True: the rank kept its model and optimizer and rolls them back in place (no re-run of the script)
    in_place: bool = False


@event("restore")
class Restore(Event):
    """Rank 0 loaded state (on every start, a fresh one included). ``t`` = load finished.

    Every earlier execution of a step >= ``step`` is thereby rolled back."""

    step: int  # the step to resume at
    load_s: float  # read + verify + apply, seconds
    fresh: bool = False  # no checkpoint: a fresh start at step 0
    path: str | None = None  # the checkpoint directory
    source: RestoreSource | None = None  # where it came from
    saved_world_size: int | None = None  # the checkpoint's world size, when it differs from this run's
    # Nothing read at the restore: every rank of an in-place round held the commit already (a
    # survivor's own copy, ``source: process``; a hot spare's preload, read from ``source`` earlier).
    preloaded: bool = False


@event("restore_rejected")
class RestoreRejected(Event):
    """A checkpoint failed verification or download; the restore fell back to an older one (rank 0)."""

    path: str  # the rejected checkpoint (directory or URL)
    step: int  # its step
    reason: str  # why


@event("rollback")
class Rollback(Event):
    """The supervisor's decision after a loss spike: replay, or roll further back and skip."""

    from_step: int  # the step the spike happened at
    to_step: int  # the newest checkpoint step the next attempt may restore
    mode: RollbackMode  # replay the same batches, or skip a window
    reason: str = ""  # human-readable
    skip_from: int | None = None  # mode skip: first skipped step
    skip_to: int | None = None  # mode skip: first step after the window
    abandoned: tuple[int, ...] = ()  # mode skip: checkpoint steps moved to checkpoints/abandoned/
    data_driven: bool = False  # mode skip: the replay reproduced the spike (the data, not the machine)


@event("spike")
class Spike(Event):
    """The loss guard fired; every rank agreed (rank 0)."""

    step: int  # the step whose loss tripped the guard
    reason: str  # what the guard saw
    value: float | None = None  # the mean loss (None for NaN/inf)


@event("skip")
class Skip(Event):
    """Rank 0 skipped a batch window a ``skip`` rollback decided: its steps never run."""

    skipped_from: int  # first skipped step
    skipped_to: int  # first step after the window (training resumes there)


@event("give_up")
class GiveUp(Event):
    """A breaker stopped the run (supervisor); ``run_end`` follows."""

    reason: str  # which breaker, in words


@event("node_lost")
class NodeLost(Event):
    """A node's agent vanished and the node did not answer a probe (srun backend)."""

    node: str  # the lost node
    reason: str  # human-readable
    job: str | None = None  # the Slurm job id


@event("slot_dropped")
class SlotDropped(Event):
    """The local backend stopped using a worker slot that kept failing (``--min-nproc``)."""

    slot: int  # the local slot (its LOCAL_RANK in the first attempt; its GPU, where there are GPUs)
    failures: int  # consecutive failures blamed on it
    nproc: int  # worker slots left: the next attempt's ranks per node
    reason: str  # human-readable


@event("straggler")
class Straggler(Event):
    """A rank ran a section of its steps slower than its peers, window after window (supervisor)."""

    step: int  # the step at which it was flagged
    section: TimingSection  # which per-rank timing
    seconds: float  # the rank's median of that section over the window
    peers_s: float  # the median of the other ranks' medians
    ratio: float  # seconds / peers_s
    windows: int  # consecutive windows it was slow in
    node: str | None = None  # the node the rank ran on (multi-node backends)


# ---------------------------------------------------------------------------------- checkpoints
@event("ckpt_staged")
class CkptStaged(Event):
    """A checkpoint's state was copied for the background persist (rank 0's engine)."""

    step: int  # the checkpoint's step
    stall_s: float  # time training was blocked by this checkpoint
    stage_s: float  # time to stage (copy) the state, overlapped or not
    bytes: int  # staged bytes


@event("ckpt_committed")
class CkptCommitted(Event):
    """The manifest is written: the checkpoint exists (rank 0's engine)."""

    step: int  # the checkpoint's step
    path: str  # its directory
    bytes: int  # bytes written by all ranks
    persist_s: float  # stage end -> commit, seconds
    files: int | None = None  # number of files


@event("ckpt_uploaded")
class CkptUploaded(Event):
    """A committed checkpoint was copied to object storage (rank 0's engine)."""

    step: int  # the checkpoint's step
    url: str  # where it went
    upload_s: float  # seconds
    bytes: int  # bytes uploaded


@event("ckpt_verified")
class CkptVerified(Event):
    """A checkpoint passed verification on restore (rank 0)."""

    step: int  # the checkpoint's step
    path: str  # its directory
    verify_s: float  # seconds
    source: RestoreSource  # where it came from
    one_pass: bool = False  # verified while reading into the restore's buffers (one read)
    cached_files: int | None = None  # one pass: files served from the page cache
    direct_files: int | None = None  # one pass: files read with direct I/O
    in_buffers_bytes: int | None = None  # one pass: bytes kept in the buffers for the load


@event("ckpt_failed")
class CkptFailed(Event):
    """A checkpoint save (or its upload) failed; training goes on (rank 0's engine)."""

    step: int  # the checkpoint's step
    reason: str  # why
    stage: str | None = None  # "upload" when the upload failed (the local copy is fine)


@event("ckpt_skipped")
class CkptSkipped(Event):
    """A save came due while the previous one was still persisting (rank 0's engine)."""

    step: int  # the step it came due at
    reason: str  # why


@event("ckpt_memory")
class CkptMemory(Event):
    """What the in-memory tier did with a committed checkpoint (rank 0's engine, ``--memory-tier``)."""

    step: int  # the checkpoint's step
    kept: bool  # a verified copy is now in host memory
    bytes: int  # the checkpoint's size (files + manifest)
    used_bytes: int  # bytes the tier holds after this
    budget_bytes: int  # the configured budget
    evicted: tuple[int, ...] = ()  # older steps dropped to make room
    copy_s: float | None = None  # kept: copy + verify seconds
    node: str | None = None  # the node whose memory holds it
    peer: str | None = None  # the peer node holding a replica (None: none, see reason)
    reason: str | None = None  # not kept: why; kept: a note (e.g. no peer on a single node)


@event("ckpt_deleted")
class CkptDeleted(Event):
    """Retention deleted a checkpoint (rank 0's engine)."""

    step: int  # the checkpoint's step
    path: str  # its directory or URL
    reason: str  # why ("retention")


@event("interval")
class Interval(Event):
    """The checkpoint interval policy decided (rank 0; see docs/reliability.md)."""

    step: int  # the step the decision was taken at
    policy: IntervalMode  # steps, time or auto
    model: str | None = None  # auto: "daly", or "bootstrap" before enough measurements
    every_steps: int | None = None  # the interval in steps
    every_s: float | None = None  # the interval in seconds (tau)
    delta_s: float | None = None  # checkpoint cost (stall), seconds
    interference_s: float | None = None  # training time a background persist costs, seconds
    mtbf_s: float | None = None  # the MTBF the policy used
    mtbf_source: str | None = None  # "configured", "history", "history+configured" or "default"
    persist_s: float | None = None  # measured persist time
    step_s: float | None = None  # measured step time without stall


# ---------------------------------------------------------------------------------- drills
@event("inject")
class Inject(Event):
    """A drill fault fired on purpose (the rank it fired on)."""

    json_names: ClassVar[Mapping[str, str]] = {"fault": "kind"}
    fault: str  # the fault kind: kill, hang, nan, ... (gpufleet.train.faults); ledger key ``kind``
    fault_id: int  # the fault's index in the --inject list
    step: int  # the step it fired at
    spec: str  # the spec as given, e.g. "kill:rank=1,step=40"
    persist: bool = False  # fires again after every restart


# ---------------------------------------------------------------------------------- fleet ledger
@event("node_state")
class NodeState(Event):
    """A node changed state (fleet ledger; see docs/health.md)."""

    node: str  # the node
    state: NodeStateName  # its new state
    reason: str  # why
    component: Component = Component.UNKNOWN  # the part blamed
    by: Actor = Actor.GPUFLEET  # who changed it
    check: str | None = None  # the health check behind it
    remedy: Remedy | None = None  # what the node needs (the XID/SXID class behind the failure)


@event("health_result")
class HealthResult(Event):
    """One health check's result on one node (fleet ledger)."""

    node: str  # the node checked
    plan: str  # the plan run
    profile: str  # the hardware profile
    check: str  # the check's name
    status: str  # OK, WARN, FAIL or INCOMPLETE (gpufleet.health.results.Status)
    valid_until: float  # wall time the result expires
    value: float | None = None  # the measured value, in ``unit``
    unit: str = ""  # the unit of value and threshold
    threshold: float | None = None  # the limit it was held to
    detail: str = ""  # human-readable
    hint: str = ""  # what to do about it
    duration_s: float = 0.0  # how long the check ran
    component: str = "unknown"  # the part checked
    device: str | None = None  # the device, for per-device results


@event("slurm_action")
class SlurmAction(Event):
    """gpufleet drained or resumed a Slurm node (fleet ledger, and the run's ledger when in a run)."""

    node: str  # the node
    action: SlurmActionKind  # drain or resume
    reason: str  # the Slurm reason set (drain) or why (resume)
    check: str | None = None  # drain: the check behind it
    previous: str | None = None  # resume: the drain reason it cleared


@event("slurm_breaker_open")
class SlurmBreakerOpen(Event):
    """The circuit breaker refused a drain: too many nodes isolated recently (an alert)."""

    node: str  # the node not drained
    hit: int  # nodes isolated within the window, this one included
    total: int  # nodes in the cluster
    window_s: float  # the breaker's window
    max_fraction: float  # the breaker's limit
    check: str  # the check that asked for the drain
    detail: str  # its detail


@event("slurm_action_skipped")
class SlurmActionSkipped(Event):
    """A drain or resume was not done: the node is not gpufleet's to touch."""

    node: str  # the node
    action: SlurmActionKind  # what was not done
    why: str  # why


@event("slurm_action_failed")
class SlurmActionFailed(Event):
    """A drain or resume command failed."""

    node: str  # the node
    action: SlurmActionKind  # what failed
    error: str  # the error


class OperatorActionKind(enum.StrEnum):
    """An action an operator asked for through ``gpufleet mcp --allow-actions``."""

    DRAIN_NODE = "drain_node"
    STOP_RUN = "stop_run"
    START_HEALTH_CHECK = "start_health_check"


class ActionResult(enum.StrEnum):
    """What came of an operator action (``operator_action.result``)."""

    DONE = "done"  # carried out
    REFUSED = "refused"  # not allowed (not gpufleet's node, breaker open, run not running)
    FAILED = "failed"  # tried, and it failed


@event("operator_action")
class OperatorAction(Event):
    """An action asked for through ``gpufleet mcp --allow-actions`` (fleet ledger): the audit trail."""

    action: OperatorActionKind  # what was asked
    target: str  # the node or run it was asked for
    requested_by: str  # who asked (the tool's ``requested_by`` argument)
    result: ActionResult  # what came of it
    via: str = "mcp"  # the interface it came through
    client: str | None = None  # the MCP client's name, when it sent one
    detail: str = ""  # what happened, in words


class K8sActionKind(enum.StrEnum):
    CORDON = "cordon"  # cordon + NoSchedule taint + owned annotation + reputation label
    UNCORDON = "uncordon"  # all of that undone


@event("k8s_action")
class K8sAction(Event):
    """gpufleet isolated or returned a Kubernetes node, or declined to (fleet ledger, and the run's)."""

    node: str  # the node
    action: K8sActionKind  # what was asked
    result: ActionResult  # done; refused (an admin's cordon, not ours, breaker open); failed (API error)
    reason: str  # the owned reason set (done), or why not
    check: str | None = None  # the check behind a cordon


class RayActionKind(enum.StrEnum):
    QUARANTINE = "quarantine"  # a detached actor holds all of the node's gpufleet resource
    RELEASE = "release"  # that hold ended


@event("ray_action")
class RayAction(Event):
    """gpufleet quarantined or released a Ray node, or declined to (fleet ledger): the audit trail."""

    node: str  # the node (first 12 hex digits of its Ray node id)
    action: RayActionKind  # what was asked
    result: ActionResult  # done; refused (breaker open, no resource to hold, not held); failed (Ray error)
    reason: str  # the quarantine's reason (done), or why not
    check: str | None = None  # the check (or operator) behind it


class NodePlatform(enum.StrEnum):
    """Where a node action is taken (``node_action.platform``)."""

    SLURM = "slurm"
    K8S = "k8s"
    RAY = "ray"


class NodeActionKind(enum.StrEnum):
    """A node action, on any platform (``node_action.action``)."""

    ISOLATE = "isolate"  # Slurm drain; Kubernetes cordon + taint + label; Ray quarantine (resource held)
    RELEASE = "release"  # that isolation undone (resume, uncordon, hold ended)


@event("node_action")
class NodeAction(Event):
    """gpufleet isolated or released a node, or declined to (fleet ledger, and the run's): the audit
    trail of every platform's node actions, and what the circuit breaker counts."""

    node: str  # the node, as the platform names it (a Ray node: the first 12 hex digits of its id)
    platform: NodePlatform  # slurm, k8s or ray
    action: NodeActionKind  # what was asked
    result: ActionResult  # done; refused (not gpufleet's node, breaker open, nothing to hold); failed
    reason: str  # the owned reason set (isolate, done), why (release), or why not
    check: str | None = None  # the check (or operator) behind it
    previous: str | None = None  # release: the isolation reason it cleared
    hit: int | None = None  # breaker refusal: nodes isolated within the window, this one included
    total: int | None = None  # breaker refusal: nodes on the platform


@dataclass(frozen=True, kw_only=True, slots=True)
class UnknownEvent(Event):
    """A ledger line this reader could not type: an unknown kind (a newer writer, say) or fields that
    do not fit the kind's schema. Never written; the reliability math skips it."""

    ev: str  # the line's ``ev``
    data: Mapping[str, Any]  # the whole line
    problem: str  # why it could not be typed


# ---------------------------------------------------------------------------------- schema checks
class _Bad(Exception):
    pass


class _Field(typing.NamedTuple):
    name: str  # the attribute
    json: str  # the key in the ledger line
    tp: Any  # the resolved type
    required: bool
    default: Any  # dataclasses.MISSING when required or built by a factory
    factory: Any  # the default factory, or dataclasses.MISSING


@functools.cache
def _schema(cls: type[Event]) -> tuple[_Field, ...]:
    """The fields of ``cls``, envelope first."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        json_name = cls.json_names.get(f.name, f.name)
        out.append(_Field(f.name, json_name, hints[f.name], required, f.default, f.default_factory))
    return tuple(out)


def fields_of(cls: type[Event]) -> tuple[str, ...]:
    """The ledger keys of ``cls``'s own fields (the envelope's excluded), in declaration order."""
    envelope = {f.name for f in _schema(Event)}
    return tuple(f.json for f in _schema(cls) if f.name not in envelope)


def _coerce(value: Any, tp: Any, strict: bool, where: str) -> Any:
    """``value`` checked against (and normalised to) the type ``tp``; raises EventSchemaError."""
    try:
        return _conv(value, tp, strict)
    except _Bad as e:
        raise EventSchemaError(f"{where}: {e}") from None


def _conv(value: Any, tp: Any, strict: bool) -> Any:
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin is types.UnionType or origin is typing.Union:
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise _Bad("must not be null")
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _conv(value, a, strict)
            except _Bad as e:
                errors.append(str(e))
        raise _Bad("; ".join(errors))
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise _Bad(f"expected a list, got {value!r}")
        elem = typing.get_args(tp)[0]
        return tuple(_conv(v, elem, strict) for v in value)
    if origin is Mapping or tp is Mapping:
        if not isinstance(value, Mapping):
            raise _Bad(f"expected an object, got {value!r}")
        return value
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        if isinstance(value, tp):
            return value
        if isinstance(value, str):
            try:
                return tp(value)
            except ValueError:
                if not strict:
                    return value  # a value from a newer writer: kept as a plain string
        raise _Bad(f"{value!r} is not one of {', '.join(m.value for m in tp)}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _Bad(f"expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _Bad(f"expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise _Bad(f"expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise _Bad(f"expected a string, got {value!r}")
    raise _Bad(f"unsupported field type {tp!r}")  # pragma: no cover - a schema bug


def _kind_class(ev: str) -> type[Event]:
    cls = EVENT_TYPES.get(ev)
    if cls is None:
        raise EventSchemaError(f"unknown event kind {ev!r}; valid kinds: {', '.join(EVENT_TYPES)}")
    return cls


def make_event(ev: str, /, **fields: Any) -> Event:
    """Build (and validate) the event of kind ``ev`` from its ledger keys, strictly.

    ``v`` (the format version, set by the encoder) is accepted and ignored, so a relayed record can
    be passed as it came."""
    cls = _kind_class(ev)
    fields.pop("v", None)
    schema = _schema(cls)
    by_json = {f.json: f for f in schema}
    unknown = sorted(set(fields) - set(by_json))
    if unknown:
        raise EventSchemaError(
            f"{ev} has no field(s) {', '.join(unknown)}; its fields: {', '.join(sorted(by_json))}"
        )
    missing = [f.json for f in schema if f.required and f.json not in fields]
    if missing:
        raise EventSchemaError(f"{ev} needs field(s) {', '.join(missing)}")
    return cls(**{by_json[k].name: v for k, v in fields.items()})


def _build(cls: type[_E], values: dict[str, Any]) -> _E:
    """An instance without __post_init__'s strict check (values already checked leniently)."""
    obj = object.__new__(cls)
    for k, v in values.items():
        object.__setattr__(obj, k, v)
    return obj


def parse_event(rec: Mapping[str, Any], *, strict: bool = False) -> Event:
    """Type one ledger record (a decoded JSON line).

    Lenient (default): unknown keys are ignored, an unknown enum value stays a plain ``str``, and
    an unknown kind or a record whose fields do not fit becomes an :class:`UnknownEvent`. Strict:
    any of these raises :class:`EventSchemaError` (for records this version of gpufleet wrote).
    """
    ev = rec.get("ev")
    cls = EVENT_TYPES.get(ev) if isinstance(ev, str) else None
    if strict:
        return make_event(str(ev), **{k: v for k, v in rec.items() if k != "ev"})
    if cls is None:
        return _unknown(rec, f"unknown event kind {ev!r}")
    values: dict[str, Any] = {}
    for f in _schema(cls):
        if f.json in rec:
            try:
                values[f.name] = _conv(rec[f.json], f.tp, False)
            except _Bad as e:
                return _unknown(rec, f"{ev}.{f.json}: {e}")
        elif f.name == "mono":
            values[f.name] = math.nan
        elif f.required or f.name == "t":
            return _unknown(rec, f"{ev} lacks field {f.json}")
        else:
            values[f.name] = f.factory() if f.default is dataclasses.MISSING else f.default
    return _build(cls, values)


def _unknown(rec: Mapping[str, Any], problem: str) -> UnknownEvent:
    t = rec.get("t")
    session = rec.get("session")
    return _build(
        UnknownEvent,
        {
            "t": float(t) if isinstance(t, int | float) and not isinstance(t, bool) else math.nan,
            "mono": math.nan,
            "session": session if isinstance(session, str) else None,
            "rank": None,
            "attempt": None,
            "ev": str(rec.get("ev")),
            "data": dict(rec),
            "problem": problem,
        },
    )


def to_record(event: Event) -> dict[str, Any]:
    """The JSON object of ``event``: ``ev``, ``v``, then the fields; optional fields left at a None
    or empty-tuple default are omitted. Enum members become their strings."""
    if isinstance(event, UnknownEvent):
        raise EventSchemaError(f"an unknown event ({event.problem}) cannot be written")
    rec: dict[str, Any] = {"ev": event.kind, "v": LEDGER_VERSION}
    for f in _schema(type(event)):
        value = getattr(event, f.name)
        if (value is None or value == ()) and (f.default is None or f.default == ()):
            continue
        if f.name == "mono" and not math.isfinite(value):
            continue  # read from a record that lacked it (parse_event): omitted, never written as NaN
        if isinstance(value, enum.Enum):
            value = value.value
        elif isinstance(value, tuple):
            value = list(value)
        rec[f.json] = value
    return rec


__all__ = ["LEDGER_VERSION", "EVENT_TYPES"] + [
    name
    for name, obj in list(globals().items())
    if not name.startswith("_") and getattr(obj, "__module__", None) == __name__
]
"""Everything this module defines: the event classes and the closed sets their fields use among them."""

"""The backend interface: the only way the supervisor starts, watches and stops workers.

Two small types, in the manner of submitit's executor and job:

- :class:`Backend` starts an attempt (:meth:`~Backend.start`) and judges a failed one
  (:meth:`~Backend.after_failure`); :meth:`~Backend.prepare` and :meth:`~Backend.close` bracket it.
- :class:`Attempt` is what :meth:`Backend.start` hands back: its workers, their exit codes
  (:meth:`~Attempt.poll`), a final-checkpoint request, a stop, and the channel their events arrive on.

Restart policy, hang detection and the ledger stay in the supervisor, so the Slurm, Kubernetes and
Ray backends reuse them. A backend implements ``start`` and the four methods of its attempt; the
rest have defaults. Multi-node rendezvous travels in :class:`LaunchSpec` (``master_addr`` /
``master_port``, ``nnodes`` / ``node_rank``): each node's agent starts its local ranks.
``tests/integration/test_backend_conformance.py`` is the contract every backend passes.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from gpufleet.core import events as E
from gpufleet.core.env import Env, Platform
from gpufleet.core.launch import LaunchEnv
from gpufleet.core.ledger import EventSink

__all__ = [
    "RejoinWait",
    "LaunchSpec",
    "Worker",
    "EventChannel",
    "Attempt",
    "Blame",
    "Verdict",
    "CONTINUE",
    "Backend",
    "Submitter",
]

# Waits for the survivors of a failure to leave their round: True all in place, False one rebuilds,
# None one did not come in time (Backend.replace).
RejoinWait = Callable[[list[int]], bool | None]


@dataclass
class LaunchSpec:
    command: list[str]
    nproc_per_node: int
    env: dict[str, str] = field(default_factory=dict)  # GPUFLEET_* settings shared by all ranks
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    attempt: int = 0
    log_dir: str | None = None  # worker stdout/stderr go to LOG_DIR/attempt-A/rank-R.log (else inherited)
    # --cpu-affinity as text (none, auto, numa, 0-3:4-7), applied on each node by the backend that starts
    # its ranks (backends.resources); threads per rank default to their share of the node's CPUs there.
    cpu_affinity: str = "none"
    max_restarts: int = 0  # --max-restarts, as TORCHELASTIC_MAX_RESTARTS
    run_id: str = ""  # --rdzv-id (else the run's session), as TORCHELASTIC_RUN_ID
    # What every rank inherits from the launch (backends.environ.launch_environ): the launching
    # environment less its host-specific variables, with --env on top. A backend that delivers it
    # through a process's own environment (srun, Ray) empties it in the spec it ships to a node.
    forward: dict[str, str] = field(default_factory=dict)

    def log_path(self, rank: int) -> str | None:
        if self.log_dir is None:
            return None
        return os.path.join(self.log_dir, f"attempt-{self.attempt}", f"rank-{rank}.log")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def place(self, local_rank: int) -> LaunchEnv:
        """Where this node's ``local_rank`` sits in the job."""
        return LaunchEnv(
            rank=self.node_rank * self.nproc_per_node + local_rank,
            world_size=self.world_size,
            local_rank=local_rank,
            local_world_size=self.nproc_per_node,
        )

    def rank_env(self, local_rank: int) -> dict[str, str]:
        """The variables that place one rank of this node in the job and its rendezvous."""
        place = self.place(local_rank)
        return {
            **place.to_environ(),
            Platform.GROUP_RANK: Platform.GROUP_RANK.format(self.node_rank),
            Platform.GROUP_WORLD_SIZE: Platform.GROUP_WORLD_SIZE.format(self.nnodes),
            Platform.ROLE_NAME: Platform.ROLE_NAME.default,
            Platform.ROLE_RANK: Platform.ROLE_RANK.format(place.rank),
            Platform.ROLE_WORLD_SIZE: Platform.ROLE_WORLD_SIZE.format(place.world_size),
            Platform.MASTER_ADDR: self.master_addr,
            Platform.MASTER_PORT: Platform.MASTER_PORT.format(self.master_port),
            Platform.TORCHELASTIC_RESTART_COUNT: Platform.TORCHELASTIC_RESTART_COUNT.format(self.attempt),
            Platform.TORCHELASTIC_MAX_RESTARTS: Platform.TORCHELASTIC_MAX_RESTARTS.format(self.max_restarts),
            Platform.TORCHELASTIC_RUN_ID: self.run_id,
            Env.ATTEMPT: Env.ATTEMPT.format(self.attempt),
        }


@dataclass(frozen=True)
class Worker:
    """One thing the supervisor watches: a rank, or (multi-node backends) a node agent with its ranks.

    ``rank`` keys :meth:`Attempt.poll` and is the rank a failure of this worker is blamed on.
    """

    rank: int
    pid: int | None = None
    ranks: tuple[int, ...] = ()  # every rank behind this worker; empty means just ``rank``
    node: str | None = None

    def __post_init__(self) -> None:
        if not self.ranks:
            object.__setattr__(self, "ranks", (self.rank,))


class EventChannel(ABC):
    """Where the workers' events (heartbeats, steps, checkpoints, ...) arrive, already decoded."""

    @abstractmethod
    def read(self, timeout: float) -> list[dict[str, Any]]:
        """The events that arrived within ``timeout`` seconds (``[]`` if none), each naming its ``rank``.

        An event is the JSON object a worker's ``PipeSink`` wrote: ``ev``, ``t``, ``rank`` and fields.
        """

    def closed(self, rank: int) -> bool:
        """True when nothing more can arrive from ``rank`` (its writer is gone); False when unknown."""
        return False

    def close(self) -> None:
        """Release the channel; later reads return nothing."""
        return None


class Attempt(ABC):
    """One attempt's workers, as :meth:`Backend.start` started them."""

    spec: LaunchSpec  # as launched: a multi-node backend fills in ``nnodes`` and ``master_addr``
    workers: list[Worker]
    events: EventChannel

    @abstractmethod
    def poll(self) -> dict[int, int | None]:
        """Exit code per worker (by :attr:`Worker.rank`): None while it runs, -N if signal N killed it."""

    @abstractmethod
    def request_final_checkpoint(self) -> None:
        """Ask every live worker to checkpoint at its next step boundary and exit 0 (SIGUSR1 today)."""

    @abstractmethod
    def stop(self, grace_s: float) -> None:
        """Stop every worker and what it started: politely (SIGTERM), by force after ``grace_s``.

        When it returns, :meth:`poll` reports no worker as running.
        """

    def close(self) -> None:
        """Release what the attempt holds once it is over (the event channel)."""
        self.events.close()


@dataclass(frozen=True)
class Blame:
    """Whom the supervisor blamed for a failed attempt: a rank (:attr:`Worker.rank`) and the cause."""

    rank: int
    cause: E.FailureCause


@dataclass(frozen=True)
class Verdict:
    """A backend's word after a failed attempt: restart (on what is left), or give up and say why."""

    restart: bool = True
    reason: str = ""


CONTINUE = Verdict()


class Backend(ABC):
    """Where worker processes run. Implement :meth:`start` (and an :class:`Attempt`); the rest is optional."""

    name: ClassVar[str]
    inherits_environment: ClassVar[bool] = True
    """Whether ranks inherit the launching environment (backends.environ); else only ``--env``'s."""

    @classmethod
    def options(cls, flags: Mapping[str, Any]) -> dict[str, Any]:
        """The constructor's keywords from ``gpufleet run``'s flags (by parameter name, as Typer gives
        them). A backend without options of its own takes none."""
        del flags
        return {}

    def prepare(self, spec: LaunchSpec, *, eager: bool = False) -> None:
        """Warm up for the next attempt before a failure happens (e.g. pre-spawn standby interpreters).

        With ``eager=True`` the warm-up may use CPU at normal priority: the supervisor asks so once the
        first attempt has committed its first checkpoint (right after it starts, under in-process
        restart), and just before a restarted attempt starts (what is made then is promoted at once).
        Called with ``eager=False`` once a restarted attempt is healthy: then it must stay out of the
        running workers' way (idle priority).
        """
        return None

    @abstractmethod
    def start(self, spec: LaunchSpec) -> Attempt:
        """Start the ranks of one attempt (all nodes' for a multi-node backend)."""

    def replace(
        self,
        attempt: Attempt,
        lost: Collection[int],
        spec: LaunchSpec,
        rejoined: RejoinWait | None = None,
    ) -> Attempt | None:
        """In-process restart: the next attempt (``spec``) from ``attempt``'s surviving workers, which
        rejoin in their own processes, plus new workers for the ``lost`` ranks (killed first if alive).

        ``rejoined(survivors)``, called once the lost ranks are gone, waits for the survivors to leave
        their round and says how: True when every one kept its objects (in place), False when one runs
        its script again, None when one did not come in time. A round's ranks must be all of one kind
        (a rank that builds does collectives that one that kept its objects does not).

        None: not possible here (the default: this backend restarts whole attempts); the supervisor then
        stops ``attempt`` and calls :meth:`start`.
        """
        return None

    def after_failure(self, attempt: Attempt, ledger: EventSink, blame: Blame | None = None) -> Verdict:
        """Judge a failed, stopped attempt: may the supervisor restart?

        The default: nothing was lost that a restart needs, so restart (the supervisor's own breakers
        still apply). A multi-node backend finds lost nodes here, isolates them, records them in
        ``ledger``, and gives up when too few remain. ``blame``: the rank the supervisor blamed and
        why (the local backend drops a slot that keeps failing, with ``--min-nproc``).
        """
        return CONTINUE

    def close(self) -> None:
        """Release anything prepared but unused."""
        return None


class Submitter(ABC):
    """A batch submission (``gpufleet run --backend slurm`` or ``k8s``): it writes (and submits) a job
    whose supervisor runs the same ``gpufleet run`` inside it, on the :attr:`inner` backend."""

    inner: ClassVar[str]
    """The registered backend the supervisor uses inside the job."""

    @classmethod
    @abstractmethod
    def from_flags(cls, flags: Mapping[str, Any]) -> Submitter:
        """The submission ``gpufleet run``'s flags describe; ConfigError on a bad value."""

    @abstractmethod
    def submit(
        self, command: list[str], nproc_per_node: int, run_dir: str, supervisor_flags: list[str]
    ) -> int:
        """Write the job (and submit it unless a dry run); print where it went. The exit code."""

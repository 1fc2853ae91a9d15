"""Every environment variable gpufleet reads, declared once: its name, type, default and doc.

A declaration is a :class:`Var`: a ``str`` (the variable's name, so it keys ``os.environ`` and a
child's environment as it is) that also knows how to read itself (:meth:`Var.get`) and write itself
(:meth:`Var.format`). :class:`Env` holds gpufleet's own ``GPUFLEET_*`` variables; :class:`Platform`
the ones the platforms it runs on set (torchrun, Slurm, Kubernetes, Ray, AWS). Where a process sits
in a distributed launch (rank, world size, node name) is :class:`gpufleet.core.launch.LaunchEnv`.

Code reads a variable only through its declaration (``Env.AGENT_GRACE.get()``); a unit test checks
that no module reads ``os.environ`` itself and that every ``GPUFLEET_*`` name in the source is declared
here. The worker settings (``GPUFLEET_RUN_DIR`` ...) are validated as a whole by
:class:`gpufleet.core.settings.RunSettings`, which holds their types and defaults; their declarations
here read the raw text. Test-only variables (``GPUFLEET_TEST_*``) belong to tests/ and are not here.

Standard library only, so the CLI and ``import gpufleet`` stay light.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

from gpufleet.core.errors import ConfigError

__all__ = ["Var", "Env", "Platform", "declared", "flag", "read_env"]

T = TypeVar("T")

_DECLARED: dict[str, Var[Any]] = {}


def flag(raw: str) -> bool:
    """``1/true/yes/on`` -> True, ``0/false/no/off`` -> False (any case); ValueError else."""
    text = raw.strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(raw)


class Var(str, Generic[T]):
    """One environment variable: the ``str`` is its name; ``cast`` turns its text into a ``T``.

    Unset or empty means ``default``. Each name is declared once (a second declaration raises).
    """

    cast: Callable[[str], T]
    default: T
    doc: str

    def __new__(cls, name: str, cast: Callable[[str], T], default: T, doc: str) -> Var[T]:
        if name in _DECLARED:
            raise TypeError(f"environment variable {name} declared twice")
        var = super().__new__(cls, name)
        var.cast, var.default, var.doc = cast, default, doc
        _DECLARED[name] = var
        return var

    def raw(self, env: Mapping[str, str] | None = None) -> str | None:
        """The variable's text in ``env`` (default ``os.environ``); None when unset."""
        return (os.environ if env is None else env).get(self)

    def get(self, env: Mapping[str, str] | None = None) -> T:
        """The variable's value in ``env`` (default ``os.environ``); a bad value is a ConfigError."""
        return _parse(self, self.raw(env) or "", self.cast, self.default)

    def format(self, value: T) -> str:
        """The text a child process's environment holds for ``value``: booleans as ``1``/``0``, floats
        in their shortest exact form (``5``, ``0.25``)."""
        if isinstance(value, bool):
            return "1" if value else "0"
        if isinstance(value, float) and float(f"{value:g}") == value:
            return f"{value:g}"
        return str(value)

    def __reduce__(self) -> tuple[Any, ...]:
        return (str, (str(self),))  # pickled (a child's environment, say) as the plain name


def _parse(name: str, raw: str, cast: Callable[[str], T], default: T) -> T:
    if raw == "":
        return default
    try:
        value = cast(raw)
    except ValueError:
        kind = getattr(cast, "__name__", "value")
        raise ConfigError(f"{name}={raw!r} is not a valid {kind}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{name}={raw!r} must be finite")
    return value


def read_env(var: Var[Any], cast: Callable[[str], T], default: T, env: Mapping[str, str] | None = None) -> T:
    """``cast(value)`` of ``var`` with a caller's own default; prefer :meth:`Var.get`."""
    return _parse(var, var.raw(env) or "", cast, default)


def declared() -> Iterator[Var[Any]]:
    """Every declared variable, in declaration order."""
    return iter(tuple(_DECLARED.values()))


class Env:
    """gpufleet's own variables (docs/environment.md lists them)."""

    # Worker settings: RunSettings validates them, with their defaults (its field and flag in brackets).
    RUN_DIR = Var("GPUFLEET_RUN_DIR", str, "", "the run directory (run_dir, --run-dir)")
    CKPT_EVERY = Var(
        "GPUFLEET_CKPT_EVERY", str, "", "the checkpoint interval (checkpoint_every, --checkpoint-every)"
    )
    CKPT_DIR = Var("GPUFLEET_CKPT_DIR", str, "", "the checkpoint directory (checkpoint_dir)")
    KEEP_LAST = Var("GPUFLEET_KEEP_LAST", str, "", "checkpoints kept (keep_last, --keep-last)")
    UPLOAD = Var("GPUFLEET_UPLOAD", str, "", "s3://bucket/prefix for tiered copies (upload_url, --upload)")
    S3_ENDPOINT = Var("GPUFLEET_S3_ENDPOINT", str, "", "the S3 endpoint (s3_endpoint, --s3-endpoint)")
    MTBF = Var("GPUFLEET_MTBF", str, "", "the configured MTBF, seconds (mtbf_s, --mtbf)")
    SPIKE_WINDOW = Var("GPUFLEET_SPIKE_WINDOW", str, "", "the loss guard's window, steps (spike_window)")
    SPIKE_THRESHOLD = Var("GPUFLEET_SPIKE_THRESHOLD", str, "", "the loss guard's threshold (spike_threshold)")
    SPIKE_LEVEL = Var("GPUFLEET_SPIKE_LEVEL", str, "", "the loss guard's level (spike_level)")
    OVERLAP = Var(
        "GPUFLEET_OVERLAP", str, "", "overlap checkpoint staging with the next step (overlap_staging)"
    )
    MEMORY_TIER = Var(
        "GPUFLEET_MEMORY_TIER",
        str,
        "",
        "the in-memory checkpoint tier's budget, a size (memory_tier, --memory-tier)",
    )
    DIST_BACKEND = Var(
        "GPUFLEET_DIST_BACKEND",
        str,
        "",
        "the torch.distributed backend: auto, nccl or gloo (dist_backend, --dist-backend)",
    )
    MEMORY_TIER_DIR = Var("GPUFLEET_MEMORY_TIER_DIR", str, "/dev/shm", "the memory tier's keepers (%n: node)")
    STANDBY_CUDA = Var(
        "GPUFLEET_STANDBY_CUDA",
        flag,
        True,
        "a standby makes its slot GPU's CUDA context before promotion (0: after, as a fresh rank)",
    )
    # Supervisor -> worker plumbing (set by the supervisor and its backends, never by users).
    CONTROL_FD: Var[int | None] = Var(
        "GPUFLEET_CONTROL_FD", int, None, "the pipe a worker reports to its supervisor on"
    )
    ATTEMPT = Var("GPUFLEET_ATTEMPT", int, 0, "the attempt a worker belongs to")
    SESSION = Var("GPUFLEET_SESSION", str, "", "the `gpufleet run` session a worker belongs to")
    FAULTS = Var("GPUFLEET_FAULTS", str, "", "the drill faults (--inject) a worker fires, encoded")
    ROLLBACK = Var("GPUFLEET_ROLLBACK", str, "", "the supervisor's rollback plan for this attempt (JSON)")
    SPAWN_T: Var[float | None] = Var(
        "GPUFLEET_SPAWN_T", float, None, "wall time the supervisor spawned the worker"
    )
    STANDBY_EAGER = Var("GPUFLEET_STANDBY_EAGER", flag, False, "a standby interpreter imports torch at once")
    STANDBY_GPU: Var[int | None] = Var(
        "GPUFLEET_STANDBY_GPU", int, None, "the local rank whose GPU a standby warms before promotion"
    )
    IN_PROCESS = Var("GPUFLEET_IN_PROCESS", flag, False, "this rank may rejoin a new round in place")
    AUTO_TELEMETRY = Var(
        "GPUFLEET_AUTO_TELEMETRY", flag, False, "report optimizer steps of a script without gpufleet.init()"
    )
    SPARE: Var[int | None] = Var(
        "GPUFLEET_SPARE", int, None, "a hot spare's rank: it builds and waits in run.restore"
    )
    SPARE_READY = Var("GPUFLEET_SPARE_READY", str, "", "the file a hot spare creates once built")
    AGENT_SPEC = Var("GPUFLEET_AGENT_SPEC", str, "", "a node agent's launch spec (JSON)")
    AGENT_GRACE = Var(
        "GPUFLEET_AGENT_GRACE", float, 5.0, "seconds a node agent gives its ranks once the supervisor is gone"
    )
    K8S_CHANNEL = Var(
        "GPUFLEET_K8S_CHANNEL", str, "", "HOST:PORT TOKEN: where a Kubernetes node agent reports"
    )
    K8S_JOB = Var("GPUFLEET_K8S_JOB", str, "", "the Kubernetes job (JSON), in the supervisor's pod")
    # Health (docs/health.md).
    FLEET_DIR = Var("GPUFLEET_FLEET_DIR", str, "", "the fleet ledger's directory")
    NODE = Var("GPUFLEET_NODE", str, "", "this node's name (else SLURMD_NODENAME, else the short hostname)")
    LEMON_FAILURES = Var(
        "GPUFLEET_LEMON_FAILURES", int, 3, "failures within the window that make a node a lemon"
    )
    LEMON_WINDOW_DAYS = Var("GPUFLEET_LEMON_WINDOW_DAYS", float, 30.0, "the lemon rule's window, days")
    BREAKER_FRACTION = Var(
        "GPUFLEET_BREAKER_FRACTION", float, 0.5, "the share of nodes the breaker may isolate per window"
    )
    BREAKER_WINDOW_S = Var("GPUFLEET_BREAKER_WINDOW_S", float, 300.0, "the node breaker's window, seconds")
    NVML_MODULE = Var("GPUFLEET_NVML_MODULE", str, "pynvml", "the NVML binding the GPU checks import")
    FAKE_NVML = Var("GPUFLEET_FAKE_NVML", str, "", "a JSON file the fake NVML module reads its GPUs from")
    KERNEL_LOG = Var("GPUFLEET_KERNEL_LOG", str, "", "the kernel log the Xid check reads (default: dmesg)")
    SYSFS_ROOT = Var(
        "GPUFLEET_SYSFS_ROOT",
        str,
        "/sys",
        "the sysfs root the InfiniBand and NVMe checks read (tests: a recorded tree)",
    )
    CLOCK_FILE = Var(
        "GPUFLEET_CLOCK_FILE", str, "", "a file whose time the clock check compares with this node's"
    )
    HEALTH_PATHS = Var(
        "GPUFLEET_HEALTH_PATHS", str, "", "paths the storage checks measure (os.pathsep-separated)"
    )
    HEALTH_INJECT_SLOW = Var(
        "GPUFLEET_HEALTH_INJECT_SLOW", str, "", "check=factor: a drill that slows a measurement"
    )
    # Serving.
    CACHE_DIR = Var(
        "GPUFLEET_CACHE_DIR", str, "", "the serving benchmark's cache (default ~/.cache/gpufleet)"
    )
    SERVE_LOOP = Var("GPUFLEET_SERVE_LOOP", str, "uvloop", "the benchmark's event loop: uvloop or asyncio")


class Platform:
    """Variables the platforms gpufleet runs on set (torchrun, Slurm, Kubernetes, Ray, AWS)."""

    RANK = Var("RANK", int, 0, "this process's rank (torchrun; every gpufleet backend sets it)")
    WORLD_SIZE = Var("WORLD_SIZE", int, 1, "ranks in the job")
    LOCAL_RANK: Var[int | None] = Var(
        "LOCAL_RANK", int, None, "this process's rank on its node (default RANK)"
    )
    LOCAL_WORLD_SIZE: Var[int | None] = Var(
        "LOCAL_WORLD_SIZE", int, None, "ranks on this node (default WORLD_SIZE)"
    )
    GROUP_RANK = Var("GROUP_RANK", int, 0, "this node's index in the job")
    NODE_RANK = Var("NODE_RANK", int, 0, "the same, as some launchers name it")
    GROUP_WORLD_SIZE = Var("GROUP_WORLD_SIZE", int, 1, "nodes in the job (torchrun)")
    ROLE_NAME = Var("ROLE_NAME", str, "default", "the worker group's role (torchrun: default)")
    ROLE_RANK = Var("ROLE_RANK", int, 0, "this process's rank among its role's workers (torchrun: RANK)")
    ROLE_WORLD_SIZE = Var("ROLE_WORLD_SIZE", int, 1, "workers of its role (torchrun: WORLD_SIZE)")
    TORCHELASTIC_RESTART_COUNT = Var(
        "TORCHELASTIC_RESTART_COUNT", int, 0, "restarts before this attempt (gpufleet: the attempt number)"
    )
    TORCHELASTIC_MAX_RESTARTS = Var(
        "TORCHELASTIC_MAX_RESTARTS", int, 0, "the restart budget (gpufleet: --max-restarts)"
    )
    TORCHELASTIC_RUN_ID = Var(
        "TORCHELASTIC_RUN_ID", str, "", "the job's id (--rdzv-id; gpufleet: else the run's session)"
    )
    MASTER_ADDR = Var("MASTER_ADDR", str, "127.0.0.1", "rank 0's address, for torch's env:// rendezvous")
    MASTER_PORT = Var("MASTER_PORT", int, 29500, "rank 0's port, for torch's env:// rendezvous")
    GLOO_SOCKET_IFNAME = Var(
        "GLOO_SOCKET_IFNAME", str, "", "the interface gloo binds to (the collective check: lo)"
    )
    SLURMD_NODENAME = Var("SLURMD_NODENAME", str, "", "the Slurm node this process runs on")
    SLURM_JOB_ID: Var[str | None] = Var("SLURM_JOB_ID", str, None, "the Slurm job")
    SLURM_STEP_ID: Var[str | None] = Var("SLURM_STEP_ID", str, None, "the Slurm job step")
    SLURM_JOB_NODELIST = Var("SLURM_JOB_NODELIST", str, "", "the Slurm job's nodes (hostlist syntax)")
    SLURM_NODELIST = Var("SLURM_NODELIST", str, "", "the same, as older Slurm names it")
    SLURM_CONF = Var("SLURM_CONF", str, "/etc/slurm/slurm.conf", "the cluster's slurm.conf")
    JOB_COMPLETION_INDEX: Var[int | None] = Var(
        "JOB_COMPLETION_INDEX", int, None, "an indexed Kubernetes Job's pod index: its node rank"
    )
    RAY_ADDRESS = Var("RAY_ADDRESS", str, "", "the Ray cluster to connect to (default: auto)")
    AWS_ENDPOINT_URL_S3 = Var("AWS_ENDPOINT_URL_S3", str, "", "the S3 endpoint (AWS SDK convention)")
    AWS_ENDPOINT_URL = Var("AWS_ENDPOINT_URL", str, "", "every AWS service's endpoint (AWS SDK convention)")
    CUDA_VISIBLE_DEVICES: Var[str | None] = Var(
        "CUDA_VISIBLE_DEVICES", str, None, "the GPUs this process may use (unset: every GPU; empty: none)"
    )
    PYTHONPATH = Var(
        "PYTHONPATH", str, "", "module search path (gpufleet run prepends its telemetry start-up)"
    )

"""The backend contract (gpufleet.backends.base), run against every backend with tiny worker scripts.

Each backend runs two ranks (local: one host x 2; srun: 2 nodes x 1 of the real Slurm cluster that
.ci/run starts). The contract: ranks see the right RANK/WORLD_SIZE; poll reports exit codes (0,
nonzero, -N for a signal); a final-checkpoint request reaches every rank; stop ends a rank that
ignores SIGTERM; events a rank writes arrive through the attempt's event channel; after a failure
that lost nothing the backend's verdict is "restart". The environment contract (backends.environ):
a variable of the launching shell and one from ``--env`` reach every rank (Kubernetes: ``--env``'s
only), torchrun's variables are set, and a host-specific variable of the launching shell stays on its
host.

A new backend joins by one line in ``BACKENDS`` (a factory: pytest request -> (backend, ranks per node)).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from ray_helpers import ray_address, requires_ray
from slurm_helpers import requires_slurm

from gpufleet.backends import BACKENDS as REGISTERED
from gpufleet.backends import Attempt, Backend, LaunchSpec, backend_class, get_backend
from gpufleet.backends.environ import launch_environ
from gpufleet.backends.local import LocalBackend
from gpufleet.core.errors import UsageError
from gpufleet.core.ports import free_port

WORKER = r"""
import json, os, signal, sys, time

mode, out = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
fd = int(os.environ["GPUFLEET_CONTROL_FD"])


def emit(ev, **fields):  # what gpufleet's PipeSink writes: one JSON line per event
    os.write(fd, (json.dumps({"ev": ev, "rank": rank, "t": time.time(), **fields}) + "\n").encode())


def note(name, **data):  # for the test to read
    with open(os.path.join(out, f"{name}-{rank}.json"), "w") as f:
        json.dump({"pid": os.getpid(), **data}, f)


if mode == "env":
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "GPUFLEET_ATTEMPT", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT",
            "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID")
    seen = ("CONFORMANCE_SHELL_VAR", "CONFORMANCE_ENV_FLAG", "OLDPWD")  # may be unset
    note("env", **{k: os.environ[k] for k in keys}, **{k: os.environ.get(k) for k in seen})
elif mode == "exit3":
    sys.exit(3 if rank == 1 else 0)
elif mode == "sigkill":
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
elif mode == "events":
    for i in range(3):
        emit("hello", i=i)
elif mode == "usr1":
    asked = []
    def on_usr1(*a):  # as gpufleet's Run does: one request is enough, a duplicate is ignored
        asked.append(1)
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, on_usr1)
    emit("armed")
    while not asked:
        time.sleep(0.01)
    note("usr1")
elif mode == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    note("pid")
    emit("armed")
    while True:
        time.sleep(1)
"""

pytestmark = pytest.mark.slow

DEADLINE_S = 90.0  # generous: srun steps on a loaded 2-core host
SHELL_VAR = ("CONFORMANCE_SHELL_VAR", "from the shell")  # set in the launching environment
ENV_FLAG = ("CONFORMANCE_ENV_FLAG", "from --env")  # given as --env
HOST_VAR = ("OLDPWD", "/conformance/launching-host")  # host-specific: no other host inherits it


# ---------------------------------------------------------------------------------- backends
Factory = Callable[[pytest.FixtureRequest], tuple[Backend, int]]


def srun_backend(request: pytest.FixtureRequest) -> tuple[Backend, int]:
    from gpufleet.backends.slurm.srun import SrunBackend

    job_id, nodes = request.getfixturevalue("slurm_allocation")
    request.getfixturevalue("monkeypatch").setenv("SLURM_JOB_ID", job_id)  # srun steps join the job
    return SrunBackend(nodes=2, nodelist=nodes, agent_grace_s=1.0), 1


def ray_backend(request: pytest.FixtureRequest) -> tuple[Backend, int]:
    from gpufleet.backends.ray.backend import RayBackend

    return RayBackend(address=ray_address(), nodes=2, agent_grace_s=1.0), 1


def k8s_jobs_backend(request: pytest.FixtureRequest) -> tuple[Backend, int]:
    """The in-cluster backend against a fake API server whose kubelet runs pods as local processes."""
    pytest.importorskip("kubernetes")
    from k8s_fake import FakeCluster

    from gpufleet.backends.k8s.backend import K8sJobsBackend
    from gpufleet.backends.k8s.manifests import K8sJob

    cluster = FakeCluster()
    request.addfinalizer(cluster.close)
    run_dir = str(request.getfixturevalue("tmp_path") / "run")
    job = K8sJob(name="conf", image="-", command=["-"], nodes=2, run_mount=run_dir, event_port=free_port())
    job.agent_grace_s = 1.0  # as the other multi-node cases: a stubborn rank is killed after 1 s
    return K8sJobsBackend(job_json=job.to_json(), poll_s=0.2, clients=cluster.clients()), 1


BACKENDS = [
    pytest.param(lambda request: (LocalBackend(standby=False), 2), id="local"),
    pytest.param(lambda request: (LocalBackend(standby=True), 2), id="local-standby"),
    pytest.param(srun_backend, id="srun", marks=[pytest.mark.cluster("slurm"), requires_slurm]),
    pytest.param(ray_backend, id="ray", marks=[pytest.mark.cluster("ray"), requires_ray]),
    pytest.param(k8s_jobs_backend, id="k8s-jobs"),
]


@pytest.fixture(scope="module")
def slurm_allocation() -> Iterator[tuple[str, list[str]]]:
    """Two nodes held for this module's srun tests (the batch script holds them in a real run)."""
    p = subprocess.run(
        ["salloc", "--no-shell", "-N", "2", "-J", "gpufleet-conformance", "--immediate=60"],
        capture_output=True,
        text=True,
        timeout=90,
    )
    m = re.search(r"Granted job allocation (\d+)", p.stderr)
    assert m, f"salloc failed: {p.stderr}"
    job_id = m.group(1)
    try:
        nodelist = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%N"], capture_output=True, text=True, timeout=15, check=True
        ).stdout.strip()
        from gpufleet.backends.slurm.srun import hostnames

        yield job_id, hostnames(nodelist)
    finally:
        subprocess.run(["scancel", job_id], timeout=15, check=False)


@dataclass
class Harness:
    backend: Backend
    nproc: int
    tmp: Path
    started: list[Attempt] = field(default_factory=list)

    def start(self, mode: str, attempt: int = 0) -> Attempt:
        script = self.tmp / "worker.py"
        script.write_text(WORKER)
        out = self.tmp / f"out-{mode}-{attempt}"
        out.mkdir()
        spec = LaunchSpec(
            command=[sys.executable, str(script), mode, str(out)],
            nproc_per_node=self.nproc,
            env={"GPUFLEET_RUN_DIR": str(self.tmp / "run")},
            master_port=free_port(),
            attempt=attempt,
            log_dir=str(self.tmp / "logs"),
            max_restarts=7,
            run_id="conformance",
            # as the supervisor makes it (train/supervisor.py, _spec)
            forward=launch_environ(dict([ENV_FLAG]), inherit=self.backend.inherits_environment),
        )
        self.backend.prepare(spec)  # as the supervisor does: standbys are made here
        run = self.backend.start(spec)
        self.started.append(run)
        return run


@pytest.fixture(params=BACKENDS)
def harness(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Harness]:
    monkeypatch = request.getfixturevalue("monkeypatch")
    monkeypatch.setenv(*SHELL_VAR)  # the launching environment, as the supervisor reads it
    monkeypatch.setenv(*HOST_VAR)
    backend, nproc = request.param(request)
    (tmp_path / "run").mkdir()
    h = Harness(backend, nproc, tmp_path)
    try:
        yield h
    finally:
        for run in h.started:
            run.stop(0.5)  # no-op for attempts that ended; never leave a test's ranks behind
            run.close()
        backend.close()


def wait_exit(run: Attempt) -> dict[int, int | None]:
    end = time.monotonic() + DEADLINE_S
    while time.monotonic() < end:
        codes = run.poll()
        if all(c is not None for c in codes.values()):
            return codes
        run.events.read(0.05)
    raise AssertionError(f"workers still running after {DEADLINE_S:.0f}s: {run.poll()}")


def wait_events(run: Attempt, ev: str, count: int) -> list[dict[str, Any]]:
    got: list[dict[str, Any]] = []
    end = time.monotonic() + DEADLINE_S
    while len(got) < count and time.monotonic() < end:
        got += [e for e in run.events.read(0.1) if e.get("ev") == ev]
    assert len(got) == count, f"{len(got)} of {count} {ev!r} events arrived; codes {run.poll()}"
    return got


def notes(out: Path, name: str) -> dict[int, dict[str, Any]]:
    return {int(p.stem.rsplit("-", 1)[1]): json.loads(p.read_text()) for p in out.glob(f"{name}-*.json")}


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


# ---------------------------------------------------------------------------------- contract
def test_ranks_see_their_rank_and_world_size(harness: Harness) -> None:
    run = harness.start("env", attempt=3)
    assert wait_exit(run) == {w.rank: 0 for w in run.workers}
    assert run.spec.world_size == 2
    assert sorted(r for w in run.workers for r in w.ranks) == [0, 1]
    env = notes(harness.tmp / "out-env-3", "env")
    assert sorted(env) == [0, 1]
    for rank, e in env.items():
        assert (e["RANK"], e["WORLD_SIZE"], e["GPUFLEET_ATTEMPT"]) == (str(rank), "2", "3")
        assert e["LOCAL_WORLD_SIZE"] == str(harness.nproc) and int(e["LOCAL_RANK"]) < harness.nproc
    # one rendezvous point for all ranks
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in env.values()}) == 1
    # torchrun's variables
    for rank, e in env.items():
        assert (e["ROLE_RANK"], e["ROLE_WORLD_SIZE"]) == (str(rank), "2")
        assert e["GROUP_RANK"] == str(rank // harness.nproc)
        assert (e["TORCHELASTIC_RESTART_COUNT"], e["TORCHELASTIC_MAX_RESTARTS"]) == ("3", "7")
        assert e["TORCHELASTIC_RUN_ID"] == "conformance"
    # the environment contract: --env everywhere; the launching shell's everywhere but Kubernetes, whose
    # pods take only --env's (the fake kubelet hands its pods this process's environment, so what a pod
    # inherits is not checked there); a host-specific variable only on the launching host itself
    name = harness.backend.name
    for e in env.values():
        assert e[ENV_FLAG[0]] == ENV_FLAG[1]
        if name != "k8s-jobs":
            assert e[SHELL_VAR[0]] == SHELL_VAR[1]
        if name == "local":
            assert e[HOST_VAR[0]] == HOST_VAR[1]  # the same host: its own value
        elif name != "k8s-jobs":
            assert e[HOST_VAR[0]] != HOST_VAR[1]


@pytest.mark.parametrize("mode,codes", [("exit3", {0: 0, 1: 3}), ("sigkill", {0: 0, 1: -9})])
def test_poll_reports_exit_codes_and_signals(harness: Harness, mode: str, codes: dict[int, int]) -> None:
    run = harness.start(mode)
    got = wait_exit(run)
    by_rank = {r: got[w.rank] for w in run.workers for r in w.ranks}  # a node's code covers its ranks
    assert by_rank == codes


def test_final_checkpoint_request_reaches_every_rank(harness: Harness) -> None:
    run = harness.start("usr1")
    wait_events(run, "armed", 2)  # both ranks have their SIGUSR1 handler in place
    run.request_final_checkpoint()
    assert set(wait_exit(run).values()) == {0}
    assert sorted(notes(harness.tmp / "out-usr1-0", "usr1")) == [0, 1]


def test_stop_ends_ranks_that_ignore_sigterm(harness: Harness) -> None:
    run = harness.start("stubborn")
    wait_events(run, "armed", 2)
    pids = [n["pid"] for n in notes(harness.tmp / "out-stubborn-0", "pid").values()]
    assert len(pids) == 2 and all(alive(p) for p in pids)
    run.stop(grace_s=0.5)
    assert None not in run.poll().values()
    assert not [p for p in pids if alive(p)]


def test_events_arrive_through_the_channel_naming_their_rank(harness: Harness) -> None:
    run = harness.start("events")
    got = wait_events(run, "hello", 6)
    assert sorted((e["rank"], e["i"]) for e in got) == [(r, i) for r in (0, 1) for i in range(3)]
    assert set(wait_exit(run).values()) == {0}


def test_after_failure_verdict_is_restart_when_nothing_was_lost(harness: Harness) -> None:
    run = harness.start("exit3")
    wait_exit(run)
    run.stop(grace_s=0.5)  # the supervisor stops an attempt before asking for the verdict
    emitted: list[object] = []

    class Sink:
        def emit(self, event: object, /, **fields: Any) -> None:
            emitted.append(event)

    verdict = harness.backend.after_failure(run, Sink())
    assert verdict.restart and not emitted


# ---------------------------------------------------------------------------------- registry
def test_every_registered_backend_runs_this_suite_and_errors_list_the_choices() -> None:
    assert set(REGISTERED) <= {p.id for p in BACKENDS}
    for name in REGISTERED:
        cls = backend_class(name)
        assert issubclass(cls, Backend) and cls.name == name
    assert isinstance(get_backend("local", standby=False), LocalBackend)
    for bad in ("moon", "slurm"):  # slurm submits a batch job; it is not a supervisor backend
        with pytest.raises(UsageError, match="valid backends: local, srun"):
            get_backend(bad)

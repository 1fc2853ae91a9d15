"""Worker resource defaults under the real supervisor (issue 9, part 1): each rank's thread share
unless the user exported OMP_NUM_THREADS, said once; --cpu-affinity on fresh and promoted standby
ranks; standby interpreters import at idle priority and are promoted at normal priority, unprivileged."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpufleet.backends.resources import CpuAffinity, host_plan, usable_cpus
from gpufleet.backends.zygote import Zygote

pytestmark = pytest.mark.slow

PROBE = str(Path(__file__).parent / "scripts" / "resources_probe.py")
GPUFLEET = [sys.executable, "-m", "gpufleet.cli.main"]
NOTE = "gpufleet: setting OMP_NUM_THREADS="


def run_probe(
    run_dir: Path, *flags: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """gpufleet run -n 2 on the probe; rank 1 fails attempt 0, so there are two attempts."""
    cmd = [
        *GPUFLEET,
        "run",
        "-n",
        "2",
        "--run-dir",
        str(run_dir),
        "--no-progress",
        "--hang-timeout",
        "30",
        *flags,
        "--",
        sys.executable,
        PROBE,
        "--fail-rank",
        "1",
    ]
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**base, **(env or {})})
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def probes(run_dir: Path) -> dict[tuple[int, int], dict]:
    out = {}
    for f in run_dir.glob("probe-*.json"):
        _, attempt, rank = f.stem.split("-")
        out[int(attempt), int(rank)] = json.loads(f.read_text())
    assert set(out) == {(0, 0), (0, 1), (1, 0), (1, 1)}, sorted(out)
    return out


@pytest.mark.parametrize("standby", ["--standby", "--no-standby"])
def test_each_worker_gets_its_share_of_the_cpus_said_once(tmp_path: Path, standby: str) -> None:
    p = run_probe(tmp_path, standby)
    share = host_plan(2, CpuAffinity())[0].threads  # 1 on the 2-CPU test host
    for (attempt, rank), got in probes(tmp_path).items():
        assert got["vars"]["OMP_NUM_THREADS"] == str(share), (attempt, rank, got)
        assert got["vars"]["MKL_NUM_THREADS"] == got["vars"]["OPENBLAS_NUM_THREADS"] == str(share)
        assert got["torch_threads"] == share, (attempt, rank, got)
        assert got["policy"] == os.SCHED_OTHER and got["child_policy"] == os.SCHED_OTHER, got
        assert got["cpus"] == sorted(usable_cpus())  # --cpu-affinity none: inherited
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith(NOTE)]
    assert len(lines) == 1, p.stderr[-3000:]  # once per run, not per attempt or rank
    assert f"OMP_NUM_THREADS={share} " in lines[0]


def test_a_user_set_omp_num_threads_is_left_alone(tmp_path: Path) -> None:
    p = run_probe(tmp_path, env={"OMP_NUM_THREADS": "2"})
    for got in probes(tmp_path).values():
        assert got["vars"]["OMP_NUM_THREADS"] == "2"
        assert got["vars"]["MKL_NUM_THREADS"] is None  # nothing added beside the user's choice
        assert got["torch_threads"] == 2
    assert NOTE not in p.stderr


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 usable CPUs")
@pytest.mark.parametrize("standby", ["--standby", "--no-standby"])
def test_cpu_affinity_pins_every_thread_of_each_rank(tmp_path: Path, standby: str) -> None:
    a, b = sorted(usable_cpus())[:2]
    run_probe(tmp_path, standby, "--cpu-affinity", f"{a}:{b}")
    for (attempt, rank), got in probes(tmp_path).items():
        want = [a] if rank == 0 else [b]
        assert got["cpus"] == want, (attempt, rank, got)
        assert got["thread_cpus"] == [want], (attempt, rank, got)  # OpenMP/gloo threads included
        assert got["torch_threads"] == 1


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory an unprivileged user can write (pytest's tmp_path is private to root)."""
    d = Path(tempfile.mkdtemp(prefix="gpufleet-standby-"))
    d.chmod(0o777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _unprivileged() -> list[str]:
    if os.getuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("root without setpriv: cannot run the standby unprivileged")
    return [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all"]


@pytest.mark.parametrize("eager", [False, True])
def test_zygote_imports_at_idle_priority_and_its_standby_is_promoted_at_normal_priority_unprivileged(
    shared_dir: Path, eager: bool
) -> None:
    # eager (the first attempt's spares): the imports run at normal priority, and nothing of it reaches
    # the training script. An extra import in the zygote's warm-up records the policy of the thread that
    # runs it; the script its standby is promoted to records its main thread's and a new thread's. The
    # zygote, and so the standby it forks, runs as nobody.
    (shared_dir / "probe_import.py").write_text(
        "import json, os, threading\n"
        "with open(os.path.join(os.path.dirname(__file__), 'import.json'), 'w') as f:\n"
        "    json.dump({'policy': os.sched_getscheduler(0),\n"
        "               'main': threading.current_thread() is threading.main_thread()}, f)\n"
    )
    (shared_dir / "sitecustomize.py").write_text(
        "import gpufleet.train.standby as s\ns.IMPORTS = (*s.IMPORTS, 'probe_import')\n"
    )
    script = shared_dir / "promoted.py"
    script.write_text(
        "import json, os, sys, threading, torch\n"
        "seen = {}\n"
        "t = threading.Thread(target=lambda: seen.update(child=os.sched_getscheduler(0)))\n"
        "t.start(); t.join()\n"
        "x = torch.randn(64, 64); (x @ x).sum()\n"
        "json.dump({'uid': os.getuid(), 'policy': os.sched_getscheduler(0),\n"
        "           'threads': torch.get_num_threads(), 'cpus': sorted(os.sched_getaffinity(0)),\n"
        "           'eager_env': os.environ.get('GPUFLEET_STANDBY_EAGER'), **seen},\n"
        "          open(sys.argv[1], 'w'))\n"
    )
    python = shared_dir / "python"
    python.write_text(f'#!/bin/sh\nexec {" ".join(_unprivileged())} {sys.executable} "$@"\n')
    python.chmod(0o755)
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": f"{shared_dir}{os.pathsep}{src}", "OMP_NUM_THREADS": "1"}
    zygote = Zygote(str(python), env, store=False)
    r, w = os.pipe()
    try:
        proc = zygote.fork({**env, "GPUFLEET_CONTROL_FD": str(w)}, w, eager=eager)
        cpu = min(usable_cpus())
        order = {
            "env": {},
            "argv": [str(script), str(shared_dir / "out.json")],
            "module": False,
            "threads": 1,
            "cpus": [cpu],
        }
        assert proc.stdin is not None
        proc.stdin.write((json.dumps(order) + "\n").encode())
        proc.stdin.close()
        assert proc.wait(timeout=120) == 0
    finally:
        zygote.close()
        os.close(r)
        os.close(w)
    warm = json.loads((shared_dir / "import.json").read_text())
    # imports: a helper thread, at SCHED_IDLE unless eager
    assert warm == {"policy": os.SCHED_OTHER if eager else os.SCHED_IDLE, "main": False}
    out = json.loads((shared_dir / "out.json").read_text())
    if os.getuid() == 0:
        assert out["uid"] == 65534  # it really ran unprivileged
    assert out["policy"] == os.SCHED_OTHER and out["child"] == os.SCHED_OTHER  # the rank: normal priority
    assert out["cpus"] == [cpu] and out["threads"] == 1
    assert out["eager_env"] is None


TOY = str(Path(__file__).parent / "scripts" / "toy_train.py")


def toy_run(run_dir: Path, *flags: str, steps: int) -> subprocess.CompletedProcess[str]:
    cmd = [
        *GPUFLEET,
        "run",
        "-n",
        "2",
        "--run-dir",
        str(run_dir),
        "--no-progress",
        "--hang-timeout",
        "30",
        "--checkpoint-every",
        "5",
        *flags,
        "--",
        sys.executable,
        TOY,
        "--steps",
        str(steps),
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def test_min_nproc_drops_a_slot_that_keeps_failing_and_resumes_at_the_smaller_world_size(
    tmp_path: Path,
) -> None:
    # Rank 1 is killed twice in a row (after a restart from the step-5 checkpoint, again at step 22):
    # with --min-nproc 1 its slot is dropped and the run finishes on one worker, restored from a
    # checkpoint two ranks wrote (a DDP model: every rank holds the whole state).
    p = toy_run(
        tmp_path,
        "--min-nproc",
        "1",
        "--inject",
        "kill:rank=1,step=10,settle=1",
        "--inject",
        "kill:rank=1,step=22,settle=1",
        steps=40,
    )
    from gpufleet.core import events as E
    from gpufleet.core.ledger import read_typed

    events = read_typed(tmp_path)
    dropped = [e for e in events if isinstance(e, E.SlotDropped)]
    assert [(e.slot, e.failures, e.nproc, e.attempt) for e in dropped] == [(1, 2, 1, 1)]
    assert "slot 1 failed 2 times in a row (crash)" in dropped[0].reason
    assert f"gpufleet: {dropped[0].reason}" in p.stderr
    assert [e.world_size for e in events if isinstance(e, E.AttemptStart)] == [2, 2, 1]
    last = [e for e in events if isinstance(e, E.Restore) and e.attempt == 2]
    assert len(last) == 1 and last[0].saved_world_size == 2 and not last[0].fresh
    assert [e.status for e in events if isinstance(e, E.RunEnd)] == [E.RunStatus.COMPLETED]
    outs = list(tmp_path.glob("final-*.json"))
    assert len(outs) == 1  # written by the one worker of the last attempt
    final = json.loads(outs[0].read_text())
    assert final["start"] == last[0].step  # the step to run next, as restored
    assert final["steps"] == list(range(last[0].step, 40))


def test_without_min_nproc_a_failing_slot_is_never_dropped(tmp_path: Path) -> None:
    toy_run(tmp_path, "--inject", "kill:rank=1,step=4", "--inject", "kill:rank=1,step=8", steps=12)
    from gpufleet.core import events as E
    from gpufleet.core.ledger import read_typed

    events = read_typed(tmp_path)
    assert not [e for e in events if isinstance(e, E.SlotDropped)]
    assert [e.world_size for e in events if isinstance(e, E.AttemptStart)] == [2, 2, 2]


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--cpu-affinity", "sometimes"], "--cpu-affinity 'sometimes'"),
        (["--cpu-affinity", "0:0:0"], "names 3 rank(s), but --nproc-per-node is 2"),
        (["--cpu-affinity", "0:4095"], "CPU(s) 4095 of local rank 1 are not usable here"),
        (["--min-nproc", "3"], "--min-nproc 3 is more than --nproc-per-node 2"),
        (["--min-nproc", "0"], "--min-nproc"),
        (["--min-nproc", "1", "--backend", "srun"], "--min-nproc is for the local backend"),
        (["--slot-failures", "0"], "--slot-failures"),
    ],
)
def test_bad_resource_flags_are_one_line_exit_2(tmp_path: Path, flags: list[str], needle: str) -> None:
    cmd = [*GPUFLEET, "run", "-n", "2", "--run-dir", str(tmp_path / "run"), *flags, "--", sys.executable, TOY]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], p.stderr
    assert not (tmp_path / "run").exists()  # nothing started

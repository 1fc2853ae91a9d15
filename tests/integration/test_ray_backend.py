"""The Ray backend on a real Ray cluster (.ci/ray.sh: a head + 2 worker nodes on this host).

(1) `gpufleet run --backend ray --nodes 2` trains two ranks on two Ray nodes to the end; (2) one Ray
node dies mid-run (its raylet, its actor, the agent and the rank, all SIGKILLed): the run finishes on
the remaining node from the newest verified checkpoint, with the same world size, bit-identical to
(1), the node recorded as lost and kept out of the next placement group; (3) `gpufleet health sweep
--backend ray` runs one task per node, and with --quarantine the node made to fail its check (a fake
NVML recording, the health tests' process-boundary fake) loses its `gpufleet` resource, so new
placement groups avoid it, until `gpufleet health release`; (4) a node blamed twice in a row is
excluded; (5) gpufleet.ray in a Ray Train TorchTrainer resumes from gpufleet's verified checkpoint
after a crash and after the spike guard fires. The node-loss test runs last and leaves its node dead;
the module starts with `.ci/ray.sh heal`, which restarts a missing worker node.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ray_helpers import ray_address, requires_ray

from gpufleet.core.ledger import read_events
from gpufleet.health.fakes import FAKE_NVML_MODULE, data_path

pytestmark = [pytest.mark.slow, pytest.mark.cluster("ray"), requires_ray]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(Path(__file__).parent / "scripts" / "toy_train.py")
STEPS = 30


def run_argv(run_dir: Path, sleep: float) -> list[str]:
    return [
        sys.executable, "-m", "gpufleet.cli.main", "run", "--backend", "ray", "--address", ray_address(),
        "--nodes", "2", "-n", "1", "--run-dir", str(run_dir), "--checkpoint-every", "5",
        "--hang-timeout", "10", "--no-progress",
        "--", sys.executable, SCRIPT, "--steps", str(STEPS), "--sleep", str(sleep),
    ]  # fmt: skip


def evs(run_dir: Path, name: str) -> list[dict]:
    return [e for e in read_events(run_dir) if e["ev"] == name]


def final(run_dir: Path) -> dict:
    outs = sorted(run_dir.glob("final-*.json"), key=lambda p: p.stat().st_mtime)
    assert outs, f"no final weights in {run_dir}: {sorted(p.name for p in run_dir.iterdir())}"
    return json.loads(outs[-1].read_text())


def wait_for(pred, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (by parent pid), read from /proc in one sweep."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def heal() -> None:
    subprocess.run([str(ROOT / ".ci" / "ray.sh"), "heal"], check=True, timeout=120, capture_output=True)


@pytest.fixture(scope="module", autouse=True)
def two_worker_nodes() -> None:
    """Both worker nodes up (a previous session's node-loss test may have killed one)."""
    heal()


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """A clean 2-node x 1-rank run: two Ray nodes train; the bit-identical reference for the loss test."""
    d = tmp_path_factory.mktemp("ref")
    env = {**os.environ, "GPUFLEET_FLEET_DIR": str(d / "fleet")}
    p = subprocess.run(run_argv(d, 0.0), capture_output=True, text=True, timeout=240, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    return {"dir": d, "final": final(d)}


def test_two_ray_nodes_train_to_the_end(reference):
    d = reference["dir"]
    (start,) = evs(d, "attempt_start")
    assert start["world_size"] == 2 and len(set(start["nodes"])) == 2  # one rank on each of two nodes
    assert evs(d, "run_end")[-1]["status"] == "completed"
    assert {e["rank"] for e in evs(d, "worker_ready")} == {0, 1}  # both nodes' events relayed over TCP
    assert reference["final"]["steps"][-1] == STEPS - 1


def gpufleet_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "gpufleet.cli.main", *args]
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})}
    )


def test_health_sweep_cli_quarantines_the_failing_node_and_release_returns_it(tmp_path):
    """`gpufleet health sweep --backend ray` runs the check as one Ray task per node; the node made to
    fail (a fake NVML recording, the health tests' process-boundary fake, chosen per node through
    --env and {node}) is held out of placement only with --quarantine; `health release` returns it."""
    import ray

    from gpufleet.backends.ray import backend as R

    fleet = tmp_path / "fleet"
    plan = tmp_path / "gpu.toml"
    plan.write_text(
        'name = "ray-gpu"\nbudget_s = 60\nvalid_s = 600\n'
        '[[checks]]\nname = "gpu.inventory"\n[[checks]]\nname = "gpu.state"\n'
    )
    owned = R.connect(ray_address())
    try:
        ids = sorted(n["NodeID"] for n in R._alive_nodes(R.RESOURCE))
        assert len(ids) == 2
        bad, good = ids
        for nid, rec in ((bad, "nvml_h100_bad_gpu3.json"), (good, "nvml_h100_ok.json")):
            (tmp_path / f"nvml-{R.node_name(nid)}.json").write_text(data_path(rec).read_text())
        sweep = [
            "health", "sweep", "--backend", "ray", "--address", ray_address(), "--plan", str(plan),
            "--fleet-dir", str(fleet), "--env", f"GPUFLEET_NVML_MODULE={FAKE_NVML_MODULE}",
            "--env", f"GPUFLEET_FAKE_NVML={tmp_path}/nvml-{{node}}.json",
        ]  # fmt: skip
        total = ray.cluster_resources()[R.RESOURCE]

        # 1. without --quarantine: a report per node and the fleet ledger, but nothing changes
        p = gpufleet_cli(*sweep)
        assert p.returncode == 1, p.stderr[-2000:]  # a FAIL somewhere: health check's exit code
        assert (
            f"{R.node_name(bad)}: plan ray-gpu" in p.stdout
            and f"{R.node_name(good)}: plan ray-gpu" in p.stdout
        )
        assert "Ray health sweep" in p.stdout and "FAIL" in p.stdout
        assert R.quarantined() == {}
        assert not [e for e in read_events(fleet) if e["ev"] in ("node_action", "node_state")]

        # 2. with --quarantine: the failing node's gpufleet resource is held
        p = gpufleet_cli(*sweep, "--quarantine", "--json")
        assert p.returncode == 1, p.stderr[-2000:]
        by = {h["node_id"]: h for h in json.loads(p.stdout)}
        assert set(by) == {bad, good}
        assert (by[bad]["exit_code"], by[bad]["status"], by[bad]["quarantined"]) == (1, "FAIL", True)
        assert (by[good]["exit_code"], by[good]["status"], by[good]["quarantined"]) == (0, "OK", False)
        assert by[bad]["action"] == "quarantined" and by[good]["action"] == ""
        try:
            assert set(R.quarantined()) == {bad}
            # the cluster offers only the healthy node's units now
            wait_for(lambda: ray.available_resources().get(R.RESOURCE, 0) == total / 2, 60, "the hold")
            backend = R.RayBackend(address=ray_address(), nodes=1)
            assert backend.eligible() == [good]
            # a new placement group lands on the healthy node
            from ray.util.placement_group import (
                placement_group,
                placement_group_table,
                remove_placement_group,
            )

            pg = placement_group([{R.RESOURCE: 1}], strategy="PACK")
            ray.get(pg.ready(), timeout=60)
            assert placement_group_table(pg)["bundles_to_node_id"][0] == good
            remove_placement_group(pg)

            # 3. release by its ledger name: the resource is free again; a second release has nothing to do
            p = gpufleet_cli("health", "release", R.node_name(bad), "--address", ray_address(),
                             "--fleet-dir", str(fleet))  # fmt: skip
            assert p.returncode == 0, p.stderr[-2000:]
            assert R.quarantined() == {}
            p = gpufleet_cli("health", "release", R.node_name(bad), "--address", ray_address(),
                             "--fleet-dir", str(fleet))  # fmt: skip
            assert p.returncode == 1 and "not quarantined" in p.stderr
        finally:
            from gpufleet.backends.ray import quarantine as H

            H.release(bad)  # whatever failed above, never leave the hold behind for the next tests
        wait_for(lambda: ray.available_resources().get(R.RESOURCE, 0) == total, 60, "the release")
        fleet_evs = read_events(fleet)
        checked = [e["node"] for e in fleet_evs if e["ev"] == "health_result"]
        assert sorted(set(checked)) == sorted({R.node_name(bad), R.node_name(good)})
        per_sweep = sum(len(h["report"]["results"]) for h in by.values())
        assert len(checked) == 2 * per_sweep  # both sweeps recorded every node's every result
        states = [(e["node"], e["state"], e["by"]) for e in fleet_evs if e["ev"] == "node_state"]
        assert states == [
            (R.node_name(bad), "suspect", "gpufleet"),
            (R.node_name(bad), "in_service", "admin"),
        ]
        audit = [(e["node"], e["action"], e["result"]) for e in fleet_evs if e["ev"] == "node_action"]
        assert audit == [
            (R.node_name(bad), "isolate", "done"),
            (R.node_name(bad), "release", "done"),
            (R.node_name(bad), "release", "refused"),
        ]  # the audit trail
    finally:
        if owned:
            ray.shutdown()


TRAINER = str(Path(__file__).parent / "scripts" / "ray_trainer.py")


@pytest.mark.timeout(600)  # three Ray Train worker groups, one after another, on a loaded host
def test_torchtrainer_loop_resumes_from_gpufleets_verified_checkpoint_after_a_crash_and_a_spike(tmp_path):
    """gpufleet.ray in a Ray Train TorchTrainer (2 workers, FailureConfig(max_failures=2)), one fit:
    rank 1 dies at step 6, then gpufleet's NaN drill fires at step 10 and the spike guard raises
    SpikeDetected on every rank. Each time Ray Train restarts the worker group and every rank resumes
    from gpufleet's newest verified checkpoint, and the third group runs the remaining steps once each
    and completes the run."""
    d = tmp_path / "run"
    d.mkdir()
    argv = [sys.executable, TRAINER, "--address", ray_address(), "--run-dir", str(d), "--steps", "14",
            "--crash-at", "6", "--nan-at", "10"]  # fmt: skip
    p = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and '"error": null' in p.stdout, p.stdout[-2000:] + p.stderr[-3000:]
    assert (d / "crashed").read_text() == "6" and (d / "spiked").read_text() == "10"
    events = read_events(d)  # rank 0 writes the run's ledger; all three groups append to it
    restores = [e for e in events if e["ev"] == "restore"]
    # a fresh start, then two retries, each from the newest verified checkpoint when its group failed:
    # each drill waited for the checkpoint before it to commit, so those are steps 4 and 8
    assert [(r["step"], r["fresh"]) for r in restores] == [(0, True), (4, False), (8, False)]
    for r in restores[1:]:
        assert (
            Path(r["path"]).name == f"step_{r['step']:08d}" and (Path(r["path"]) / "manifest.json").exists()
        )
    # the spike: gpufleet's drill fired (inject), the guard saw the non-finite loss (spike) in the second
    # group, before the third group's restore
    second = events[events.index(restores[1]) : events.index(restores[2])]
    drill = [(e["ev"], e["step"]) for e in second if e["ev"] in ("inject", "spike")]
    assert drill == [("inject", 10), ("spike", 10)]
    assert next(e for e in second if e["ev"] == "inject")["kind"] == "nan"
    assert "non-finite" in next(e for e in second if e["ev"] == "spike")["reason"]
    assert not [e for e in events[events.index(restores[2]) :] if e["ev"] in ("inject", "spike")]
    out = final(d)  # written by the last group's rank 0: it ran each remaining step once
    assert out["start"] == 8 and out["steps"] == list(range(8, 14))
    assert [e["status"] for e in events if e["ev"] == "run_end"] == ["completed"]


def test_a_node_that_keeps_failing_is_excluded(tmp_path, monkeypatch):
    """One node is blamed for two failures in a row (node_failures=2): it is marked suspect and kept
    out of the next placement group, which then packs both ranks on the other node. The failing rank
    is whichever runs on that node (the first attempt's rank 1's): placement groups do not promise a
    rank the same node twice."""
    from gpufleet.backends import Blame, LaunchSpec
    from gpufleet.backends.ray.backend import RayBackend
    from gpufleet.core import events as E
    from gpufleet.core.ledger import Ledger

    monkeypatch.setenv("GPUFLEET_FLEET_DIR", str(tmp_path / "fleet"))
    marker = tmp_path / "bad_node"
    script = tmp_path / "w.py"
    script.write_text(
        "import os, pathlib, sys\n"
        f"bad = pathlib.Path({str(marker)!r})\n"
        "fail = os.environ['GPUFLEET_NODE'] == bad.read_text() if bad.exists() else "
        "os.environ['RANK'] == '1'\n"
        "sys.exit(3 if fail else 0)\n"
    )
    (tmp_path / "run").mkdir()
    backend = RayBackend(address=ray_address(), nodes=2, agent_grace_s=1.0)
    bad = None
    try:
        with Ledger(tmp_path / "run") as ledger:
            for attempt in range(2):
                spec = LaunchSpec(
                    command=[sys.executable, str(script)], nproc_per_node=1, attempt=attempt,
                    env={"GPUFLEET_RUN_DIR": str(tmp_path / "run")},
                )  # fmt: skip
                run = backend.start(spec)
                wait_for(lambda run=run: None not in run.poll().values(), 90, "the attempt to end")
                codes = run.poll()
                assert sorted(codes.values()) == [0, 3], codes
                failed = next(r for r, c in codes.items() if c == 3)
                node = next(w.node for w in run.workers if w.rank == failed)
                assert bad is None or node == bad  # the second time: the same node failed
                bad = node
                marker.write_text(bad)
                run.stop(0.5)
                run.close()
                verdict = backend.after_failure(run, ledger, Blame(failed, E.FailureCause.CRASH))
                assert verdict.restart
        assert [node_name_of(n) for n in backend.excluded] == [bad]
        (state,) = evs(tmp_path / "run", "node_state")
        assert (state["node"], state["state"], state["check"]) == (bad, "suspect", "node-failures")
        run = backend.start(
            LaunchSpec(command=[sys.executable, "-c", "pass"], nproc_per_node=1, attempt=2,
                       env={"GPUFLEET_RUN_DIR": str(tmp_path / "run")})
        )  # fmt: skip
        assert run.spec.nnodes == 1 and run.spec.nproc_per_node == 2 and run.workers[0].node != bad
        run.stop(0.5)
        run.close()
    finally:
        backend.close()


def node_name_of(node_id: str) -> str:
    from gpufleet.backends.ray.backend import node_name

    return node_name(node_id)


def test_ray_node_loss_recovers_on_the_remaining_node_bit_identical(tmp_path, reference):
    d = tmp_path / "run"
    env = {**os.environ, "GPUFLEET_FLEET_DIR": str(tmp_path / "fleet")}
    proc = subprocess.Popen(
        run_argv(d, 0.3), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        wait_for(lambda: evs(d, "ckpt_committed") if d.exists() else False, 120, "a committed checkpoint")
        (start,) = evs(d, "attempt_start")
        victim = start["nodes"][1]  # the node running rank 1
        report = json.loads((d / "agents" / "attempt-0" / f"{victim}.json").read_text())
        actor = report["ppid"]  # the Ray worker process hosting the NodeAgent actor
        raylet = parent(actor)
        assert "raylet" in Path(f"/proc/{raylet}/cmdline").read_text()
        doomed = descendants(raylet) + report["pids"] + [report["pid"]]  # ranks live in their own sessions
        for pid in doomed:
            try:
                os.kill(pid, signal.SIGKILL)  # the node dies: raylet, its workers, the agent, the rank
            except ProcessLookupError:
                pass
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        # the killed worker node stays down: this test runs last; the next session's fixture heals it
    lost = evs(d, "node_lost")
    assert [e["node"] for e in lost] == [victim]
    starts = evs(d, "attempt_start")
    assert len(starts) == 2 and starts[-1]["nodes"] == [start["nodes"][0]]  # the survivor, alone
    assert starts[-1]["world_size"] == 2  # the same world: the survivor runs both ranks
    restores = evs(d, "restore")
    assert restores[0]["fresh"] and not restores[-1]["fresh"] and restores[-1]["step"] > 0
    assert [e["node"] for e in evs(d, "node_state")] == [victim]  # marked suspect in the run's ledger
    fleet = [e for e in read_events(tmp_path / "fleet") if e["ev"] == "node_state"]
    assert [(e["node"], e["state"]) for e in fleet] == [(victim, "suspect")]  # and in the fleet's
    assert evs(d, "run_end")[-1]["status"] == "completed"
    assert final(d)["sha256"] == reference["final"]["sha256"]

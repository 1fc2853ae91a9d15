"""The k8s-jobs backend loses a node (against tests/integration/k8s_fake.py: a fake API server whose
kubelet runs pods as local processes; no real cluster can run here).

The node dies (SIGKILL to its pod's agent and ranks; Ready turns Unknown; the pod reads NodeLost). The
attempt fails, the backend records ``node_lost``, cordons and taints the node through the real client
(an owned reason), and the next attempt's indexed Job avoids it by hostname.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpufleet.backends import LaunchSpec
from gpufleet.core.ledger import Ledger, read_events
from gpufleet.core.ports import free_port

pytest.importorskip("kubernetes")

from k8s_fake import FakeCluster  # noqa: E402

WORKER = r"""
import json, os, sys, time
fd = int(os.environ["GPUFLEET_CONTROL_FD"])
os.write(fd, (json.dumps({"ev": "armed", "rank": int(os.environ["RANK"]), "t": time.time()}) + "\n").encode())
while True:
    time.sleep(1)
"""


def test_lost_node_is_recorded_cordoned_and_avoided(tmp_path, monkeypatch):
    from gpufleet.backends.k8s.backend import K8sJobsBackend
    from gpufleet.backends.k8s.manifests import K8sJob

    monkeypatch.setenv("GPUFLEET_FLEET_DIR", str(tmp_path / "fleet"))
    (tmp_path / "run").mkdir()
    (tmp_path / "w.py").write_text(WORKER)
    cluster = FakeCluster(nodes=3)
    job = K8sJob(
        name="t", image="-", command=["-"], nodes=2, run_mount=str(tmp_path / "run"), event_port=free_port()
    )
    backend = K8sJobsBackend(job_json=job.to_json(), poll_s=0.1, clients=cluster.clients())
    try:
        spec = LaunchSpec(
            command=[sys.executable, str(tmp_path / "w.py")], nproc_per_node=1, env={}, attempt=0
        )
        run = backend.start(spec)
        got: list[dict] = []
        end = time.monotonic() + 60
        while len(got) < 2 and time.monotonic() < end:
            got += [e for e in run.events.read(0.1) if e.get("ev") == "armed"]
        assert len(got) == 2
        assert [w.node for w in run.workers] == ["fake-node-0", "fake-node-1"]
        assert cluster.lose_node("fake-node-1")
        end = time.monotonic() + 60
        while run.poll()[1] is None and time.monotonic() < end:
            run.events.read(0.1)
        assert run.poll()[1] == -9  # the lost pod reads as killed
        run.stop(0.5)
        run.close()
        with Ledger(tmp_path / "run") as ledger:
            verdict = backend.after_failure(run, ledger)
        assert verdict.restart
        evs = read_events(tmp_path / "run")
        assert [(e["ev"], e["node"]) for e in evs if e["ev"] in ("node_lost", "node_action")] == [
            ("node_lost", "fake-node-1"),
            ("node_action", "fake-node-1"),
        ]
        ((node, patch),) = cluster.patches
        assert node == "fake-node-1" and patch["spec"]["unschedulable"] is True
        assert patch["metadata"]["annotations"]["gpufleet.io/cordon-reason"].startswith(
            "gpufleet: node-lost: "
        )
        # the next attempt's Job keeps off the node, by hostname
        run = backend.start(LaunchSpec(command=spec.command, nproc_per_node=1, env={}, attempt=1))
        assert [w.node for w in run.workers] == ["fake-node-0", "fake-node-2"]
        run.stop(0.5)
        run.close()
        assert any(
            r.startswith("DELETE /apis/batch/v1/namespaces/default/jobs/t-a1") for r in cluster.requests
        )
        fleet = [json.loads(x) for x in (tmp_path / "fleet" / "ledger.jsonl").read_text().splitlines()]
        assert ("fake-node-1", "drained") in [(e["node"], e.get("state")) for e in fleet]
    finally:
        backend.close()
        cluster.close()


def test_submit_creates_the_runs_objects_through_the_client(tmp_path):
    """`gpufleet run --backend k8s` (no --dry-run) creates every object but attempt 0's worker Job (the
    supervisor creates that one), in kubectl.txt's order, against the fake server via a kubeconfig."""
    from k8s_fake import write_kubeconfig

    cluster = FakeCluster()
    try:
        write_kubeconfig(tmp_path / "kubeconfig", cluster.url)
        argv = [
            sys.executable, "-m", "gpufleet.cli.main", "run", "--backend", "k8s", "--nodes", "2", "-n", "1",
            "--image", "ghcr.io/acme/train:1.0", "--job-name", "llama", "--namespace", "ml",
            "--run-dir", str(tmp_path / "run"), "--", "python", "train.py",
        ]  # fmt: skip
        env = {
            **os.environ,
            "KUBECONFIG": str(tmp_path / "kubeconfig"),
            "GPUFLEET_FLEET_DIR": str(tmp_path / "f"),
        }
        p = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
        assert p.returncode == 0, p.stderr
        assert "created run llama in namespace ml" in p.stderr
        made = [(path, obj["kind"], obj["metadata"]["name"]) for path, obj in cluster.created]
        assert made == [
            ("/api/v1/namespaces/ml/serviceaccounts", "ServiceAccount", "llama-supervisor"),
            ("/apis/rbac.authorization.k8s.io/v1/namespaces/ml/roles", "Role", "llama-supervisor"),
            (
                "/apis/rbac.authorization.k8s.io/v1/namespaces/ml/rolebindings",
                "RoleBinding",
                "llama-supervisor",
            ),
            ("/api/v1/namespaces/ml/services", "Service", "llama-supervisor"),
            ("/apis/batch/v1/namespaces/ml/jobs", "Job", "llama-supervisor"),
            ("/api/v1/namespaces/ml/services", "Service", "llama-workers"),
            ("/apis/policy/v1/namespaces/ml/poddisruptionbudgets", "PodDisruptionBudget", "llama-workers"),
            ("/apis/apps/v1/namespaces/ml/daemonsets", "DaemonSet", "gpufleet-health"),
            ("/api/v1/namespaces/kube-system/configmaps", "ConfigMap", "gpufleet-npd"),
        ]
        written = {json.loads(q.read_text())["metadata"]["name"] + "/" + json.loads(q.read_text())["kind"]
                   for q in (tmp_path / "run" / "k8s").glob("*.json")}  # fmt: skip
        assert {f"{n}/{k}" for _, k, n in made} == written - {"llama-a0/Job"}
    finally:
        cluster.close()


TOY = str(Path(__file__).parent / "scripts" / "toy_train.py")


def supervise(run_dir: Path, env: dict[str, str], *flags: str, sleep: float) -> subprocess.Popen[str]:
    argv = [
        sys.executable, "-m", "gpufleet.cli.main", "run", *flags, "--run-dir", str(run_dir),
        "--checkpoint-every", "5", "--hang-timeout", "10", "--no-progress", "--no-standby",
        "--", sys.executable, TOY, "--steps", "20", "--sleep", str(sleep),
    ]  # fmt: skip
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def test_supervisor_in_a_fake_pod_survives_a_node_loss_bit_identical(tmp_path):
    """`gpufleet run --backend k8s-jobs` (what the supervisor pod runs) trains 2 pods x 1 rank against
    the fake cluster; one node dies mid-run; the next attempt runs on a replacement node, from the
    newest verified checkpoint, and ends bit-identical to a plain 2-rank run."""
    from k8s_fake import write_kubeconfig

    from gpufleet.backends.k8s.manifests import K8sJob

    ref = tmp_path / "ref"
    base = {**os.environ, "GPUFLEET_FLEET_DIR": str(tmp_path / "fleet")}
    p = supervise(ref, base, "-n", "2", sleep=0.0)  # the reference: local backend, same world size
    _, err = p.communicate(timeout=240)
    assert p.returncode == 0, err[-3000:]

    cluster = FakeCluster(nodes=3)
    try:
        run_dir = tmp_path / "run"
        write_kubeconfig(tmp_path / "kubeconfig", cluster.url)
        job = K8sJob(
            name="toy", image="-", command=["-"], nodes=2, run_mount=str(run_dir),
            event_port=free_port(), master_port=free_port(),
        )  # fmt: skip
        env = {**base, "KUBECONFIG": str(tmp_path / "kubeconfig"), "GPUFLEET_K8S_JOB": job.to_json()}
        proc = supervise(run_dir, env, "--backend", "k8s-jobs", "--nodes", "2", "-n", "1", sleep=0.2)
        try:
            end = time.monotonic() + 120
            while time.monotonic() < end and not (
                (run_dir / "ledger.jsonl").exists()
                and any(e["ev"] == "ckpt_committed" for e in read_events(run_dir))
            ):
                time.sleep(0.2)
            assert cluster.lose_node("fake-node-1")
            _, err = proc.communicate(timeout=240)
            assert proc.returncode == 0, err[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
        evs = read_events(run_dir)
        starts = [e for e in evs if e["ev"] == "attempt_start"]
        assert [s["nodes"] for s in starts] == [
            ["fake-node-0", "fake-node-1"],
            ["fake-node-0", "fake-node-2"],
        ]
        assert [e["node"] for e in evs if e["ev"] == "node_lost"] == ["fake-node-1"]
        restores = [e for e in evs if e["ev"] == "restore"]
        assert restores[0]["fresh"] and restores[-1]["step"] > 0 and not restores[-1]["fresh"]
        assert [e["status"] for e in evs if e["ev"] == "run_end"] == ["completed"]
        assert [n for n, _ in cluster.patches] == ["fake-node-1"]  # cordoned, with gpufleet's reason
        final = json.loads(
            sorted(run_dir.glob("final-*.json"), key=lambda q: q.stat().st_mtime)[-1].read_text()
        )
        reference = json.loads(next(ref.glob("final-*.json")).read_text())
        assert final["sha256"] == reference["sha256"]
    finally:
        cluster.close()

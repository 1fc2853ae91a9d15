"""`gpufleet run --backend k8s --dry-run`: the manifests it writes validate strictly against the
Kubernetes schemas (kubernetes-validate --strict), match the golden files, and say what they must:
indexed Job + headless Service rendezvous, restarts left to gpufleet, bad nodes kept out, PDB, preStop
final checkpoint, the health DaemonSet and node-problem-detector's plugin with NPD's exit codes.
No API server is involved (none can run here); docs/backends/k8s.md says so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpufleet.backends.k8s import manifests as M
from gpufleet.health.nodes import record_state

GOLDEN = Path(__file__).parent / "golden"
K8S_VERSION = "1.33.0"  # the oldest schema kubernetes-validate ships that has every field used here


def gf(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpufleet.cli.main", *args],
        capture_output=True, text=True, timeout=120, env={**os.environ, **env},
    )  # fmt: skip


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    """The dry run of a 2-pod x 4-rank run, with one node in the fleet's exclude list."""
    tmp = tmp_path_factory.mktemp("k8s")
    fleet = tmp / "fleet"
    record_state("gpu-node-7", "suspect", "xid 79", component="gpu", fleet=fleet)
    p = gf(
        "run", "--backend", "k8s", "--dry-run", "--nodes", "2", "-n", "4",
        "--image", "ghcr.io/acme/train:1.0", "--job-name", "llama", "--namespace", "ml",
        "--run-claim", "runs", "--run-dir", str(tmp / "run"),
        "--checkpoint-every", "50", "--", "python", "train.py", "--lr", "3e-4",
        env={"GPUFLEET_FLEET_DIR": str(fleet)},
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "not applied" in p.stderr
    return tmp / "run" / "k8s"


def load(d: Path, name: str) -> dict:
    return json.loads((d / name).read_text())


def test_every_manifest_matches_its_golden_file(written):
    names = sorted(p.name for p in written.iterdir())
    if os.environ.get("UPDATE_GOLDEN"):
        for old in GOLDEN.glob("*"):
            old.unlink()
        for n in names:
            (GOLDEN / n).write_text((written / n).read_text())
    assert names == sorted(p.name for p in GOLDEN.iterdir())
    for n in names:
        got, want = (written / n).read_text(), (GOLDEN / n).read_text()
        assert got == want, f"{n} changed; rerun with UPDATE_GOLDEN=1 if intended"


def test_every_manifest_validates_strictly(written):
    files = sorted(str(p) for p in written.glob("*.json"))
    assert len(files) == 10
    for version in (K8S_VERSION, "1.37.0"):
        p = subprocess.run(
            [str(Path(sys.executable).parent / "kubernetes-validate"), "--strict", "-k", version, *files],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert p.returncode == 0, p.stdout + p.stderr
        assert p.stdout.count("passed") == len(files), p.stdout


def test_strict_validation_rejects_what_the_schema_lacks(written, tmp_path):
    """The check above has teeth: one unknown field, or a misspelt one, fails it."""
    import kubernetes_validate as kv

    job = load(written, "worker-job.json")
    kv.validate(job, K8S_VERSION, strict=True)  # as written: valid
    job["spec"]["template"]["spec"]["containers"][0]["preStopp"] = {}
    with pytest.raises(kv.ValidationError):
        kv.validate(job, K8S_VERSION, strict=True)
    bad = load(written, "worker-pdb.json")
    bad["spec"]["maxUnavailable"] = [0]
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, K8S_VERSION, strict=True)


def test_worker_job_leaves_restarts_to_gpufleet_and_rendezvous_to_the_headless_service(written):
    job, svc = load(written, "worker-job.json"), load(written, "worker-service.json")
    spec = job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 2, 2)
    assert spec["backoffLimit"] == 0 and spec["template"]["spec"]["restartPolicy"] == "Never"
    actions = {r["action"] for r in spec["podFailurePolicy"]["rules"]}
    assert actions == {"FailJob"}  # any pod failure ends the attempt; the supervisor restarts it
    pod = spec["template"]["spec"]
    assert svc["spec"]["clusterIP"] == "None" and pod["subdomain"] == svc["metadata"]["name"]
    assert svc["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    (agent,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in agent["env"]}
    launch = json.loads(env["GPUFLEET_AGENT_SPEC"])
    # pod 0's DNS name under the headless Service: JOB-0.SERVICE.NAMESPACE.svc
    assert launch["master_addr"] == f"{job['metadata']['name']}-0.{svc['metadata']['name']}.ml.svc"
    assert (launch["nnodes"], launch["nproc_per_node"]) == (2, 4)
    assert launch["command"] == ["python", "train.py", "--lr", "3e-4"]
    assert env["GPUFLEET_K8S_CHANNEL"].startswith("llama-supervisor:29400 ")
    assert agent["command"] == ["python", "-m", "gpufleet.backends.k8s"]
    assert agent["lifecycle"]["preStop"]["exec"]["command"][3] == "prestop"
    assert pod["terminationGracePeriodSeconds"] == 120


def test_bad_nodes_are_kept_out_and_the_pdb_guards_the_workers(written):
    pod = load(written, "worker-job.json")["spec"]["template"]["spec"]
    required = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    (term,) = required["nodeSelectorTerms"]
    assert {"key": M.REPUTATION_LABEL, "operator": "NotIn", "values": ["bad"]} in term["matchExpressions"]
    by_host = {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["gpu-node-7"]}
    assert by_host in term["matchExpressions"]  # from the fleet's node state log
    pdb = load(written, "worker-pdb.json")
    assert pdb["spec"]["maxUnavailable"] == 0
    assert pdb["spec"]["selector"]["matchLabels"] == {M.LABEL_RUN: "llama", M.LABEL_ROLE: "worker"}


def test_supervisor_job_runs_the_in_cluster_backend_with_the_flags(written):
    job = load(written, "supervisor-4-job.json")
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert c["command"][:4] == ["gpufleet", "run", "--backend", "k8s-jobs"]
    assert c["command"][c["command"].index("--checkpoint-every") + 1] == "50"
    assert c["command"][c["command"].index("--") + 1 :] == ["python", "train.py", "--lr", "3e-4"]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert M.K8sJob.from_json(env["GPUFLEET_K8S_JOB"]).nodes == 2
    role = load(written, "supervisor-1-role.json")
    assert {"create", "delete"} <= set(next(r for r in role["rules"] if r["resources"] == ["jobs"])["verbs"])


def test_health_daemonset_and_npd_plugin(written):
    ds = load(written, "health-daemonset.json")
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    assert "gpufleet health watch" in c["command"][-1]
    tolerations = ds["spec"]["template"]["spec"]["tolerations"]
    # it keeps watching a node gpufleet tainted, to see it recover
    assert {"key": M.TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"} in tolerations
    cm = load(written, "npd-configmap.json")
    monitor = json.loads(cm["data"]["gpufleet-health-monitor.json"])
    assert monitor["plugin"] == "custom" and monitor["rules"][0]["path"] == "/config/gpufleet-check.sh"


@pytest.mark.parametrize("gpufleet_rc,npd_rc", [(0, 0), (1, 1), (2, 2), (3, 2)])
def test_npd_script_maps_gpufleet_exit_codes(tmp_path, gpufleet_rc, npd_rc):
    """The plugin script, run for real with a stand-in `gpufleet` on PATH that exits as told."""
    fake = tmp_path / "gpufleet"
    fake.write_text(f"#!/bin/sh\necho 'gpu.state FAIL gpu3 xid 79'\nexit {gpufleet_rc}\n")
    fake.chmod(0o755)
    script = tmp_path / "check.sh"
    script.write_text(M.npd_configmap()["data"]["gpufleet-check.sh"])
    p = subprocess.run(
        ["sh", str(script)], capture_output=True, text=True, timeout=30,
        env={**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "NODE_NAME": "n1"},
    )  # fmt: skip
    assert p.returncode == npd_rc == M.NPD_EXIT_MAP[gpufleet_rc]
    assert len(p.stdout) <= 200


@pytest.mark.parametrize(
    "flags, needle",
    [
        ([], "--image is required"),
        (["--image", "x", "--job-name", "Bad_Name"], "must be a DNS label"),
        (["--image", "x", "--nodes", "2", "--min-nodes", "3"], "--min-nodes (3) <= --nodes (2)"),
        (["--image", "x", "--backend", "k9s"], "valid backends:"),
    ],
)
def test_bad_flags_are_one_line_exit_2(tmp_path, flags, needle):
    argv = ["run", "--backend", "k8s", "--dry-run", "--run-dir", str(tmp_path), *flags, "--", "python"]
    p = gf(*argv, env={"GPUFLEET_FLEET_DIR": str(tmp_path / "fleet")})
    assert p.returncode == 2 and needle in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr

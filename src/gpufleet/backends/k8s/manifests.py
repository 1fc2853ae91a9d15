"""The Kubernetes objects of a gpufleet run, as plain dicts (pure functions; no client needed).

One run named NAME in namespace NS (``gpufleet run --backend k8s --nodes M -n K --image IMG``):

- ``NAME-supervisor``: a ServiceAccount, a Role and a RoleBinding (jobs, pods, services in NS), a
  one-pod Job running the supervisor (``gpufleet run --backend k8s-jobs``; Kubernetes restarts only
  *it*, on its own failure: it resumes from the shared run directory) and a ClusterIP Service on
  which the node agents reach it (their event channel, the srun backend's pipe over TCP).
- ``NAME-workers``: a headless Service over the run's worker pods, for torch rendezvous:
  ``MASTER_ADDR`` is pod 0's DNS name ``NAME-aA-0.NAME-workers.NS.svc``.
- ``NAME-aA``: attempt A's indexed Job (the supervisor creates one per attempt): M pods, one gpufleet
  node agent each (``python -m gpufleet.backends.k8s``), ``JOB_COMPLETION_INDEX`` is the node rank.
  ``backoffLimit: 0`` and a ``podFailurePolicy`` that fails the Job on any pod failure leave restarts
  to the supervisor (from the newest verified checkpoint). Required node affinity keeps the pods off
  nodes with a bad reputation (label ``gpufleet.io/reputation=bad``, which the health action sets,
  and the fleet's exclude list by hostname). A preStop hook asks the agent for a final checkpoint
  (SIGUSR1, like Slurm's ``--signal=USR1``) and waits for it, within the grace period.
- ``NAME-workers`` PodDisruptionBudget: no voluntary eviction of a running attempt's pods.
- ``gpufleet-health``: a DaemonSet running ``gpufleet health watch`` on GPU nodes, and
  ``gpufleet-npd``: a ConfigMap with node-problem-detector's custom-plugin monitor that runs the quick
  plan (exit codes mapped to NPD's 0 OK / 1 problem / 2 unknown) and its script.

Every object here validates with ``kubernetes-validate --strict`` (tests/unit/backends/k8s).
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpufleet.core.env import Env
from gpufleet.core.errors import ConfigError

__all__ = [
    "K8sJob", "LABEL_RUN", "LABEL_ROLE", "LABEL_ATTEMPT", "REPUTATION_LABEL", "TAINT_KEY", "EVENT_PORT",
    "supervisor_objects", "worker_service", "worker_job", "pdb", "health_daemonset", "npd_configmap",
    "all_objects", "write_manifests", "NPD_EXIT_MAP",
]  # fmt: skip

LABEL_RUN = "gpufleet.io/run"
LABEL_ROLE = "gpufleet.io/role"
LABEL_ATTEMPT = "gpufleet.io/attempt"
REPUTATION_LABEL = "gpufleet.io/reputation"  # "bad" on nodes the health action isolated
TAINT_KEY = "gpufleet.io/unhealthy"  # NoSchedule taint the health action sets
EVENT_PORT = 29400  # the supervisor's event-channel port (agents connect to it)
MASTER_PORT = 29500  # torch rendezvous on pod 0
RUN_MOUNT = "/gpufleet/run"
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$")  # room for "-supervisor" and "-aNNN-NNN"
# gpufleet health exit codes -> node-problem-detector's: 0 OK, 1 problem, anything else unknown.
NPD_EXIT_MAP = {0: 0, 1: 1, 2: 2, 3: 2}


@dataclass(kw_only=True, slots=True)
class K8sJob:
    """What a Kubernetes run is: the training command, its shape, image and placement."""

    name: str
    """Run name: a DNS label (lowercase letters, digits, '-'), at most 40 characters."""
    image: str
    """Container image with gpufleet and the training code."""
    command: list[str]
    """The training command (``python train.py ...``), as after ``--``."""
    nodes: int = 1
    """Worker pods (one gpufleet node agent each)."""
    nproc_per_node: int = 1
    """Ranks per pod."""
    min_nodes: int | None = None
    """Go on with fewer pods down to this after a lost node (default: nodes)."""
    namespace: str = "default"
    """Namespace of every object."""
    gpus_per_node: int = 0
    """``nvidia.com/gpu`` per worker pod (0: CPU only)."""
    cpus_per_node: str = "1"
    """CPU request per worker pod."""
    memory_per_node: str = "2Gi"
    """Memory request per worker pod."""
    run_claim: str | None = None
    """PersistentVolumeClaim (ReadWriteMany) holding the run directory; None: an emptyDir (use --upload)."""
    supervisor_flags: list[str] = field(default_factory=list)
    """Extra ``gpufleet run`` flags for the supervisor (checkpoint interval, budgets, ...)."""
    exclude_nodes: list[str] = field(default_factory=list)
    """Node names kept out by hostname (the fleet's exclude list)."""
    grace_s: int = 120
    """Pod termination grace: time for the preStop final checkpoint."""
    service_account: str | None = None
    """Use this ServiceAccount instead of creating ``NAME-supervisor`` with its Role."""
    run_mount: str = RUN_MOUNT
    """Where the run directory is mounted in every pod."""
    event_port: int = EVENT_PORT
    """The supervisor's event-channel port."""
    master_port: int = MASTER_PORT
    """torch.distributed's rendezvous port on pod 0."""
    agent_grace_s: float = Env.AGENT_GRACE.default
    """How long a node agent gives its ranks between SIGTERM and SIGKILL."""

    def __post_init__(self) -> None:
        if not _DNS_LABEL.match(self.name):
            raise ConfigError(
                f"run name (--job-name) {self.name!r} must be a DNS label, at most 40 characters ([a-z0-9-])"
            )
        if not _DNS_LABEL.match(self.namespace):
            raise ConfigError(f"namespace {self.namespace!r} is not a DNS label")
        if not self.image:
            raise ConfigError("--image is required for --backend k8s")
        if not self.command:
            raise ConfigError(
                "no training command given; usage: gpufleet run --backend k8s ... -- python train.py"
            )
        if self.nodes < 1 or self.nproc_per_node < 1 or self.gpus_per_node < 0 or self.grace_s < 1:
            raise ConfigError("--nodes and -n must be >= 1")
        if self.min_nodes is not None and not 1 <= self.min_nodes <= self.nodes:
            raise ConfigError(f"need 1 <= --min-nodes ({self.min_nodes}) <= --nodes ({self.nodes})")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> K8sJob:
        return cls(**json.loads(text))


def _meta(job: K8sJob, name: str, role: str, **extra: str) -> dict[str, Any]:
    labels = {"app.kubernetes.io/name": "gpufleet", LABEL_RUN: job.name, LABEL_ROLE: role, **extra}
    return {"name": name, "namespace": job.namespace, "labels": labels}


def _run_volume(job: K8sJob) -> tuple[dict[str, Any], dict[str, Any]]:
    if job.run_claim:
        vol: dict[str, Any] = {"name": "run", "persistentVolumeClaim": {"claimName": job.run_claim}}
    else:
        vol = {"name": "run", "emptyDir": {}}
    return vol, {"name": "run", "mountPath": job.run_mount}


# ------------------------------------------------------------------------------------- supervisor
def supervisor_objects(job: K8sJob) -> list[dict[str, Any]]:
    """RBAC (unless ``service_account``), the supervisor's Service and its one-pod Job."""
    name = f"{job.name}-supervisor"
    out: list[dict[str, Any]] = []
    sa = job.service_account or name
    if job.service_account is None:
        out.append({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(job, name, "supervisor")})
        out.append(
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "Role",
                "metadata": _meta(job, name, "supervisor"),
                "rules": [
                    {
                        "apiGroups": ["batch"],
                        "resources": ["jobs"],
                        "verbs": ["create", "get", "list", "watch", "delete"],
                    },
                    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
                    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list"]},
                ],
            }
        )
        out.append(
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "RoleBinding",
                "metadata": _meta(job, name, "supervisor"),
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
                "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": job.namespace}],
            }
        )
    port = job.event_port
    out.append(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _meta(job, name, "supervisor"),
            "spec": {
                "selector": {LABEL_RUN: job.name, LABEL_ROLE: "supervisor"},
                "ports": [{"name": "events", "port": port, "targetPort": port, "protocol": "TCP"}],
            },
        }
    )
    vol, mount = _run_volume(job)
    argv = ["gpufleet", "run", "--backend", "k8s-jobs", "--nodes", str(job.nodes)]
    argv += ["-n", str(job.nproc_per_node), "--run-dir", job.run_mount, "--no-progress"]
    if job.min_nodes is not None:
        argv += ["--min-nodes", str(job.min_nodes)]
    argv += [*job.supervisor_flags, "--", *job.command]
    out.append(
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": _meta(job, name, "supervisor"),
            "spec": {
                "backoffLimit": 3,  # the supervisor's own crash: Kubernetes restarts it, it resumes the run
                "template": {
                    "metadata": {"labels": {LABEL_RUN: job.name, LABEL_ROLE: "supervisor"}},
                    "spec": {
                        "serviceAccountName": sa,
                        "restartPolicy": "OnFailure",
                        "containers": [
                            {
                                "name": "supervisor",
                                "image": job.image,
                                "command": argv,
                                "env": [
                                    {"name": Env.K8S_JOB, "value": job.to_json()},
                                    {"name": Env.FLEET_DIR, "value": f"{job.run_mount}/fleet"},
                                ],
                                "ports": [{"name": "events", "containerPort": job.event_port}],
                                "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}},
                                "volumeMounts": [mount],
                            }
                        ],
                        "volumes": [vol],
                    },
                },
            },
        }
    )
    return out


# ----------------------------------------------------------------------------------------- workers
def worker_service(job: K8sJob) -> dict[str, Any]:
    """Headless Service over the run's worker pods: stable DNS names for torch rendezvous."""
    port = job.master_port
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(job, f"{job.name}-workers", "worker"),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,  # rendezvous happens before any readiness
            "selector": {LABEL_RUN: job.name, LABEL_ROLE: "worker"},
            "ports": [{"name": "rendezvous", "port": port, "targetPort": port, "protocol": "TCP"}],
        },
    }


def master_addr(job: K8sJob, attempt: int) -> str:
    """Pod 0's DNS name in attempt ``attempt`` (an indexed Job pod's hostname is JOB-INDEX)."""
    return f"{job.name}-a{attempt}-0.{job.name}-workers.{job.namespace}.svc"


def _affinity(job: K8sJob) -> dict[str, Any]:
    expr: list[dict[str, Any]] = [{"key": REPUTATION_LABEL, "operator": "NotIn", "values": ["bad"]}]
    if job.exclude_nodes:
        expr.append(
            {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": sorted(job.exclude_nodes)}
        )
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": expr}]
            }
        },
        # one pod per node: a node lost takes one agent with it, as on Slurm
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {
                    "labelSelector": {"matchLabels": {LABEL_RUN: job.name, LABEL_ROLE: "worker"}},
                    "topologyKey": "kubernetes.io/hostname",
                }
            ]
        },
    }


def worker_job(
    job: K8sJob,
    attempt: int,
    spec_env: dict[str, str] | None = None,
    token: str = "TOKEN",
    nodes: int | None = None,
    exclude_nodes: list[str] | None = None,
    command: list[str] | None = None,
    nproc_per_node: int | None = None,
    forward: dict[str, str] | None = None,
    max_restarts: int = 0,
    run_id: str = "",
) -> dict[str, Any]:
    """Attempt ``attempt``'s indexed Job: ``nodes`` pods (default ``job.nodes``), one agent each.

    ``forward``: the ``--env`` variables every rank gets (the LaunchSpec's; on Kubernetes only those,
    never the supervisor pod's own environment); ``max_restarts`` and ``run_id``: torchrun's
    TORCHELASTIC_MAX_RESTARTS and TORCHELASTIC_RUN_ID.
    ``spec_env``: the attempt's GPUFLEET_* settings (the supervisor's LaunchSpec env); ``token`` the
    hello token the agents present on the event channel; ``exclude_nodes`` more hostnames to avoid;
    ``command`` / ``nproc_per_node``: the attempt's, when they differ from the job's.
    """
    m = nodes or job.nodes
    name = f"{job.name}-a{attempt}"
    if exclude_nodes:
        job = K8sJob(**{**asdict(job), "exclude_nodes": sorted(set(job.exclude_nodes) | set(exclude_nodes))})
    launch = {
        "command": command or job.command,
        "nproc_per_node": nproc_per_node or job.nproc_per_node,
        "env": {Env.RUN_DIR: job.run_mount, **(spec_env or {})},
        "nnodes": m,
        "master_addr": master_addr(job, attempt),
        "master_port": job.master_port,
        "attempt": attempt,
        "max_restarts": max_restarts,
        "run_id": run_id,
        "forward": dict(forward or {}),
    }
    vol, mount = _run_volume(job)
    requests: dict[str, str] = {"cpu": job.cpus_per_node, "memory": job.memory_per_node}
    resources: dict[str, Any] = {"requests": dict(requests)}
    if job.gpus_per_node:
        resources["limits"] = {"nvidia.com/gpu": str(job.gpus_per_node)}
    labels = {LABEL_RUN: job.name, LABEL_ROLE: "worker", LABEL_ATTEMPT: str(attempt)}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _meta(job, name, "worker", **{LABEL_ATTEMPT: str(attempt)}),
        "spec": {
            "completionMode": "Indexed",
            "completions": m,
            "parallelism": m,
            "backoffLimit": 0,  # restarts are the supervisor's: from the newest verified checkpoint
            "podFailurePolicy": {
                "rules": [
                    {
                        "action": "FailJob",
                        "onExitCodes": {"containerName": "agent", "operator": "NotIn", "values": [0]},
                    },
                    {
                        "action": "FailJob",
                        "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
                    },
                ]
            },
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "restartPolicy": "Never",  # podFailurePolicy requires it
                    "subdomain": f"{job.name}-workers",
                    "affinity": _affinity(job),
                    "terminationGracePeriodSeconds": job.grace_s,
                    "containers": [
                        {
                            "name": "agent",
                            "image": job.image,
                            "command": ["python", "-m", "gpufleet.backends.k8s"],
                            "env": [
                                {"name": Env.AGENT_SPEC, "value": json.dumps(launch, sort_keys=True)},
                                {
                                    "name": Env.K8S_CHANNEL,
                                    "value": f"{job.name}-supervisor:{job.event_port} {token}",
                                },
                                {"name": Env.AGENT_GRACE, "value": Env.AGENT_GRACE.format(job.agent_grace_s)},
                                {
                                    "name": Env.NODE,
                                    "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}},
                                },
                            ],
                            "ports": [{"name": "rendezvous", "containerPort": job.master_port}],
                            "lifecycle": {
                                "preStop": {
                                    "exec": {
                                        "command": [
                                            "python",
                                            "-m",
                                            "gpufleet.backends.k8s",
                                            "prestop",
                                            "--wait",
                                            str(max(1, job.grace_s - 10)),
                                        ]  # fmt: skip
                                    }
                                }
                            },
                            "resources": resources,
                            "volumeMounts": [mount],
                        }
                    ],
                    "volumes": [vol],
                },
            },
        },
    }


def pdb(job: K8sJob) -> dict[str, Any]:
    """No voluntary eviction (node drain, autoscaler) of a running attempt's pods: isolation goes
    through gpufleet, which checkpoints first."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(job, f"{job.name}-workers", "worker"),
        "spec": {
            "maxUnavailable": 0,
            "selector": {"matchLabels": {LABEL_RUN: job.name, LABEL_ROLE: "worker"}},
        },
    }


# ------------------------------------------------------------------------------------------ health
def health_daemonset(image: str, namespace: str = "default", interval_s: int = 300) -> dict[str, Any]:
    """`gpufleet health watch` on every GPU node, tolerating gpufleet's own taint (to see it recover)."""
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {
            "name": "gpufleet-health",
            "namespace": namespace,
            "labels": {"app.kubernetes.io/name": "gpufleet-health"},
        },
        "spec": {
            "selector": {"matchLabels": {"app.kubernetes.io/name": "gpufleet-health"}},
            "template": {
                "metadata": {"labels": {"app.kubernetes.io/name": "gpufleet-health"}},
                "spec": {
                    "nodeSelector": {"nvidia.com/gpu.present": "true"},
                    "tolerations": [
                        {"key": TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"},
                        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                    ],
                    "priorityClassName": "system-node-critical",
                    "containers": [
                        {
                            "name": "watch",
                            "image": image,
                            "command": [
                                "sh",
                                "-c",
                                "exec gpufleet health watch --plan quick "
                                f'--interval {interval_s} --node "$NODE_NAME"',
                            ],
                            "env": [
                                {
                                    "name": "NODE_NAME",
                                    "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}},
                                },
                                {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
                                {"name": Env.KERNEL_LOG, "value": "/host/dev/kmsg"},
                                {"name": Env.FLEET_DIR, "value": "/var/lib/gpufleet/fleet"},
                            ],
                            "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}},
                            "volumeMounts": [
                                {"name": "kmsg", "mountPath": "/host/dev/kmsg", "readOnly": True},
                                {"name": "fleet", "mountPath": "/var/lib/gpufleet"},
                            ],
                        }
                    ],
                    "volumes": [
                        {"name": "kmsg", "hostPath": {"path": "/dev/kmsg", "type": "CharDevice"}},
                        {
                            "name": "fleet",
                            "hostPath": {"path": "/var/lib/gpufleet", "type": "DirectoryOrCreate"},
                        },
                    ],
                },
            },
        },
    }


NPD_SCRIPT = """#!/bin/sh
# node-problem-detector custom plugin: gpufleet's quick health plan on this node.
# NPD reads exit codes 0 = OK, 1 = problem, anything else = unknown; gpufleet health check exits
# 0 (OK/WARN), 1 (FAIL), 2 (bad input), 3 (INCOMPLETE only): 2 and 3 become NPD's unknown (2).
out=$(gpufleet health check --plan quick --no-record --node "${NODE_NAME:-$(hostname)}" 2>&1)
rc=$?
case $rc in
  0) echo "gpufleet quick plan: OK"; exit 0 ;;
  1) echo "$out" | grep -m 3 FAIL | tr -s ' ' | cut -c1-200; exit 1 ;;
  *) echo "gpufleet quick plan: unknown (exit $rc)"; exit 2 ;;
esac
"""


def npd_monitor(interval: str = "5m", timeout: str = "60s") -> dict[str, Any]:
    """node-problem-detector custom-plugin monitor config running :data:`NPD_SCRIPT`."""
    return {
        "plugin": "custom",
        "pluginConfig": {
            "invoke_interval": interval,
            "timeout": timeout,
            "max_output_length": 200,
            "concurrency": 1,
        },
        "source": "gpufleet-health",
        "metricsReporting": True,
        "conditions": [
            {
                "type": "GpufleetUnhealthy",
                "reason": "GpufleetHealthy",
                "message": "gpufleet quick plan passes",
            }
        ],
        "rules": [
            {
                "type": "permanent",
                "condition": "GpufleetUnhealthy",
                "reason": "GpufleetCheckFailed",
                "path": "/config/gpufleet-check.sh",
                "timeout": timeout,
            }
        ],
    }


def npd_configmap(namespace: str = "kube-system") -> dict[str, Any]:
    """The ConfigMap to mount at NPD's /config: the monitor JSON and its check script."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "gpufleet-npd",
            "namespace": namespace,
            "labels": {"app.kubernetes.io/name": "gpufleet-npd"},
        },
        "data": {
            "gpufleet-health-monitor.json": json.dumps(npd_monitor(), indent=2, sort_keys=True) + "\n",
            "gpufleet-check.sh": NPD_SCRIPT,
        },
    }


# ------------------------------------------------------------------------------------------- all
def all_objects(job: K8sJob) -> dict[str, dict[str, Any] | list[dict[str, Any]]]:
    """Every object of the run by file stem; ``worker-job`` is attempt 0's (the supervisor makes it)."""
    return {
        "supervisor": supervisor_objects(job),
        "worker-service": worker_service(job),
        "worker-pdb": pdb(job),
        "worker-job": worker_job(job, 0),
        "health-daemonset": health_daemonset(job.image, job.namespace),
        "npd-configmap": npd_configmap(),
    }


def write_manifests(job: K8sJob, out_dir: str | Path) -> list[Path]:
    """One JSON file per object under ``out_dir`` (kubectl apply -f and kubernetes-validate read JSON)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for stem, objs in all_objects(job).items():
        for i, obj in enumerate(objs if isinstance(objs, list) else [objs]):
            kind = obj["kind"].lower()
            p = out / (f"{stem}-{i}-{kind}.json" if isinstance(objs, list) else f"{stem}.json")
            p.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
            paths.append(p)
    (out / "apply-order.txt").write_text("\n".join(p.name for p in paths) + "\n")
    (out / "kubectl.txt").write_text(
        "# what `gpufleet run --backend k8s` creates, from this directory (the supervisor creates each\n"
        "# attempt's worker Job itself; worker-job.json is attempt 0's, for review):\n"
        + "".join(f"kubectl apply -f {shlex.quote(p.name)}\n" for p in paths if p.name != "worker-job.json")
    )
    return paths

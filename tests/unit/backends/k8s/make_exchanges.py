"""Writes exchanges/*.json, the API exchanges test_k8s_actions.py replays: `python make_exchanges.py`.

Written from the Kubernetes API reference's shapes (Node, NodeList, Status; a strategic-merge PATCH of
a Node), not captured from a live cluster: no API server can run on these machines. Re-run after
changing a scenario; the JSON files are what the tests read.
"""

import json
from pathlib import Path

OUT = Path(__file__).parent / "exchanges"
OWN = "gpufleet.io/cordon-reason"


def node(name, unschedulable=False, annotations=None, labels=None, taints=None, ready=True, rv="1001"):
    spec = {"podCIDR": "10.244.3.0/24", "providerID": f"gce://acme/us-central1-a/{name}"}
    if unschedulable:
        spec["unschedulable"] = True
    if taints:
        spec["taints"] = taints
    return {
        "kind": "Node",
        "apiVersion": "v1",
        "metadata": {
            "name": name,
            "uid": "6f1c2a3e-0b9d-4c55-9a57-" + name.encode().hex()[:12].ljust(12, "0"),
            "resourceVersion": rv,
            "creationTimestamp": "2026-11-20T08:00:00Z",
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "nvidia.com/gpu.present": "true",
                **(labels or {}),
            },
            "annotations": {"node.alpha.kubernetes.io/ttl": "0", **(annotations or {})},
        },
        "spec": spec,
        "status": {
            "capacity": {"cpu": "96", "memory": "1056561568Ki", "nvidia.com/gpu": "8", "pods": "110"},
            "allocatable": {"cpu": "95", "memory": "1056459168Ki", "nvidia.com/gpu": "8", "pods": "110"},
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True" if ready else "Unknown",
                    "reason": "KubeletReady" if ready else "NodeStatusUnknown",
                    "message": "kubelet is posting ready status"
                    if ready
                    else "Kubelet stopped posting node status.",
                    "lastHeartbeatTime": "2026-12-01T18:00:00Z",
                    "lastTransitionTime": "2026-11-20T08:01:00Z",
                }
            ],
            "nodeInfo": {
                "machineID": "m",
                "systemUUID": "s",
                "bootID": "b",
                "kernelVersion": "6.8.0",
                "osImage": "Ubuntu 24.04 LTS",
                "containerRuntimeVersion": "containerd://2.0.0",
                "kubeletVersion": "v1.33.2",
                "kubeProxyVersion": "v1.33.2",
                "operatingSystem": "linux",
                "architecture": "amd64",
            },
        },
    }


def node_list(names):
    return {
        "kind": "NodeList",
        "apiVersion": "v1",
        "metadata": {"resourceVersion": "2000"},
        "items": [node(n) for n in names],
    }


GET = lambda n: {"method": "GET", "path": f"/api/v1/nodes/{n}"}  # noqa: E731
LIST = {"method": "GET", "path": "/api/v1/nodes"}
SMP = "application/strategic-merge-patch+json"
CLUSTER = ["gpu-1", "gpu-2", "gpu-3", "gpu-4"]
REASON = "gpufleet: gpu.state: gpu3 xid 79 (fallen off the bus)"
TAINT = {"key": "gpufleet.io/unhealthy", "value": "gpu.state", "effect": "NoSchedule"}
CORDON = {
    "metadata": {"annotations": {OWN: REASON}, "labels": {"gpufleet.io/reputation": "bad"}},
    "spec": {"unschedulable": True, "taints": [TAINT]},
}
UNCORDON = {
    "metadata": {"annotations": {OWN: None}, "labels": {"gpufleet.io/reputation": None}},
    "spec": {"unschedulable": None, "taints": [{"$patch": "delete", "key": "gpufleet.io/unhealthy"}]},
}
cordoned = node("gpu-2", True, {OWN: REASON}, {"gpufleet.io/reputation": "bad"}, [TAINT], rv="1002")
admin = node(
    "gpu-3",
    True,
    {"ops.acme.io/ticket": "INC-4411"},
    taints=[
        {
            "key": "node.kubernetes.io/unschedulable",
            "effect": "NoSchedule",
            "timeAdded": "2026-12-01T09:00:00Z",
        }
    ],
)
forbidden = {
    "kind": "Status",
    "apiVersion": "v1",
    "metadata": {},
    "status": "Failure",
    "message": 'nodes "gpu-2" is forbidden: User "system:serviceaccount:ml:llama-supervisor" '
    'cannot patch resource "nodes" in API group "" at the cluster scope',
    "reason": "Forbidden",
    "details": {"name": "gpu-2", "kind": "nodes"},
    "code": 403,
}
not_found = {
    "kind": "Status",
    "apiVersion": "v1",
    "metadata": {},
    "status": "Failure",
    "message": 'nodes "gpu-9" not found',
    "reason": "NotFound",
    "details": {"name": "gpu-9", "kind": "nodes"},
    "code": 404,
}


def cordon_gpu2(status, body):
    """Read gpu-2, count the cluster (the breaker), then the one strategic-merge patch."""
    patch = {"method": "PATCH", "path": "/api/v1/nodes/gpu-2", "content_type": SMP, "body": CORDON}
    return [
        {"request": GET("gpu-2"), "response": {"status": 200, "body": node("gpu-2")}},
        {"request": LIST, "response": {"status": 200, "body": node_list(CLUSTER)}},
        {"request": patch, "response": {"status": status, "body": body}},
    ]


SCENARIOS = {
    # a healthy node fails a check: read it, count the cluster (breaker), one strategic-merge patch
    "cordon_healthy": cordon_gpu2(200, cordoned),
    # gpufleet's cordon already there: nothing to do, no second patch
    "cordon_again": [{"request": GET("gpu-2"), "response": {"status": 200, "body": cordoned}}],
    # an administrator cordoned it: left alone (no taint, no annotation)
    "cordon_admin": [{"request": GET("gpu-3"), "response": {"status": 200, "body": admin}}],
    # the breaker: two nodes cordoned within the window already, a third of four would pass 50%
    "cordon_breaker": [
        {"request": GET("gpu-4"), "response": {"status": 200, "body": node("gpu-4")}},
        {"request": LIST, "response": {"status": 200, "body": node_list(CLUSTER)}},
    ],
    # RBAC refuses the patch: recorded as failed, not as done
    "cordon_forbidden": cordon_gpu2(403, forbidden),
    # release undoes only gpufleet's own cordon
    "release_owned": [
        {"request": GET("gpu-2"), "response": {"status": 200, "body": cordoned}},
        {
            "request": {
                "method": "PATCH",
                "path": "/api/v1/nodes/gpu-2",
                "content_type": SMP,
                "body": UNCORDON,
            },
            "response": {"status": 200, "body": node("gpu-2", rv="1003")},
        },
    ],
    "release_admin": [{"request": GET("gpu-3"), "response": {"status": 200, "body": admin}}],
    # node_ready: Ready=True, Ready=Unknown (kubelet gone), and a node deleted from the cluster
    "ready_checks": [
        {"request": GET("gpu-1"), "response": {"status": 200, "body": node("gpu-1")}},
        {"request": GET("gpu-2"), "response": {"status": 200, "body": node("gpu-2", ready=False)}},
        {"request": GET("gpu-9"), "response": {"status": 404, "body": not_found}},
    ],
}

for name, ex in SCENARIOS.items():
    (OUT / f"{name}.json").write_text(json.dumps(ex, indent=1, sort_keys=True) + "\n")

"""A fake Kubernetes API server whose "kubelet" runs each pod's container command as a local process.

For the backend conformance suite's ``k8s-jobs`` case: no API server or kubelet can run on these
machines, so this stands in at the HTTP boundary for the calls the ``k8s-jobs`` backend makes through the
real ``kubernetes`` client. It understands:

- ``POST .../namespaces/NS/KIND``: any object is stored (``created``); a worker Job (an indexed Job) is
  also run: each of its ``completions`` pods runs the container's ``command`` with the container's
  env (``valueFrom: spec.nodeName`` gives the pod's node), ``JOB_COMPLETION_INDEX=I``, and cluster DNS
  done by hand: the pod names under the headless Service (``MASTER_ADDR``) and the supervisor's
  Service name resolve to 127.0.0.1.
- ``GET /api/v1/namespaces/NS/pods?labelSelector=job-name=J,...``: those pods, with phase and the
  container's ``terminated.exitCode`` as a kubelet reports it (128+N for signal N).
- ``DELETE /apis/batch/v1/namespaces/NS/jobs/J``: SIGTERM to each pod's process, SIGKILL after 5 s.
- ``GET /api/v1/nodes``, ``GET /api/v1/nodes/NAME``, ``PATCH /api/v1/nodes/NAME`` (strategic merge of
  labels, annotations, ``unschedulable``): nodes ``fake-node-0..N-1``, Ready until :meth:`lose_node`.
  Pods go to the first nodes the Job's required node affinity (``kubernetes.io/hostname NotIn``) allows.

What it does not do is everything else a cluster does (scheduling, images, volumes, preStop hooks,
podFailurePolicy, DNS): docs/backends/k8s.md says so.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit


class FakeCluster:
    def __init__(self, nodes: int = 3) -> None:
        self.pods: dict[str, list[tuple[int, subprocess.Popen[bytes]]]] = {}  # job -> (index, process)
        self.placed: dict[str, list[str]] = {}  # job -> node of each pod, by index
        self.nodes = {f"fake-node-{i}": _node(f"fake-node-{i}") for i in range(nodes)}
        self.lost: set[str] = set()
        self.patches: list[tuple[str, Any]] = []
        self.created: list[tuple[str, Any]] = []  # (collection path, object) of objects only stored
        self.requests: list[str] = []
        self._lock = threading.Lock()
        cluster = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                return None

            def _reply(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _body(self) -> Any:
                n = int(self.headers.get("Content-Length") or 0)
                return json.loads(self.rfile.read(n)) if n else None

            def do_POST(self) -> None:
                cluster.requests.append(f"POST {self.path}")
                path = urlsplit(self.path).path
                body = self._body()
                if re.fullmatch(r"/apis/batch/v1/namespaces/[^/]+/jobs", path) and _is_worker_job(body):
                    cluster.run_job(body)
                    self._reply(201, body)
                elif re.fullmatch(r"/apis?/([^/]+/)?v1/namespaces/[^/]+/[a-z]+", path):
                    cluster.created.append((path, body))  # anything else is stored, not run
                    self._reply(201, body)
                else:
                    self._reply(404, {"kind": "Status", "status": "Failure", "code": 404})

            def do_GET(self) -> None:
                cluster.requests.append(f"GET {self.path}")
                url = urlsplit(self.path)
                if re.fullmatch(r"/api/v1/namespaces/[^/]+/pods", url.path):
                    sel = parse_qs(url.query).get("labelSelector", [""])[0]
                    job = dict(kv.split("=", 1) for kv in sel.split(",") if "=" in kv).get("job-name", "")
                    self._reply(
                        200,
                        {
                            "kind": "PodList",
                            "apiVersion": "v1",
                            "metadata": {},
                            "items": cluster.pod_list(job),
                        },
                    )
                elif url.path == "/api/v1/nodes":
                    self._reply(
                        200,
                        {
                            "kind": "NodeList",
                            "apiVersion": "v1",
                            "metadata": {},
                            "items": list(cluster.nodes.values()),
                        },
                    )
                elif (m := re.fullmatch(r"/api/v1/nodes/([^/]+)", url.path)) and m.group(1) in cluster.nodes:
                    self._reply(200, cluster.nodes[m.group(1)])
                else:
                    self._reply(404, {"kind": "Status", "status": "Failure", "code": 404})

            def do_PATCH(self) -> None:
                cluster.requests.append(f"PATCH {self.path}")
                m = re.fullmatch(r"/api/v1/nodes/([^/]+)", urlsplit(self.path).path)
                if m and m.group(1) in cluster.nodes:
                    self._reply(200, cluster.patch_node(m.group(1), self._body()))
                else:
                    self._reply(404, {"kind": "Status", "status": "Failure", "code": 404})

            def do_DELETE(self) -> None:
                cluster.requests.append(f"DELETE {self.path}")
                m = re.fullmatch(r"/apis/batch/v1/namespaces/[^/]+/jobs/([^/]+)", urlsplit(self.path).path)
                if m:
                    cluster.delete_job(m.group(1))
                    self._reply(200, {"kind": "Status", "apiVersion": "v1", "status": "Success"})
                else:
                    self._reply(404, {"kind": "Status", "status": "Failure", "code": 404})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def clients(self) -> tuple[Any, Any]:
        """(BatchV1Api, CoreV1Api) of the real client, talking to this server."""
        from kubernetes import client

        cfg = client.Configuration()
        cfg.host = self.url
        api = client.ApiClient(cfg)
        return client.BatchV1Api(api), client.CoreV1Api(api)

    # -- the "kubelet" -----------------------------------------------------------------------------
    def run_job(self, job: dict[str, Any]) -> None:
        name = job["metadata"]["name"]
        pod = job["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        avoid = set()
        for term in pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"
        ]:
            for e in term["matchExpressions"]:
                if e["key"] == "kubernetes.io/hostname" and e["operator"] == "NotIn":
                    avoid |= set(e["values"])
        free = [n for n in self.nodes if n not in avoid and n not in self.lost]
        count = int(job["spec"]["completions"])
        assert len(free) >= count, f"fake cluster: {count} pods, free nodes {free}"
        self.placed[name] = free[:count]
        started = []
        for i in range(count):
            env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ.get('PATH', '')}"}
            for e in c.get("env", []):
                if "value" in e:
                    env[e["name"]] = e["value"]
                elif e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "spec.nodeName":
                    env[e["name"]] = self.placed[name][i]
            env["JOB_COMPLETION_INDEX"] = str(i)
            spec = json.loads(env["GPUFLEET_AGENT_SPEC"])  # cluster DNS, by hand
            spec["master_addr"] = "127.0.0.1"
            env["GPUFLEET_AGENT_SPEC"] = json.dumps(spec)
            address, token = env["GPUFLEET_K8S_CHANNEL"].split(" ", 1)
            env["GPUFLEET_K8S_CHANNEL"] = f"127.0.0.1:{address.rsplit(':', 1)[1]} {token}"
            proc = subprocess.Popen(c["command"], env=env, stdin=subprocess.DEVNULL, start_new_session=True)
            started.append((i, proc))
        with self._lock:
            self.pods[name] = started

    def pod_list(self, job: str) -> list[dict[str, Any]]:
        with self._lock:
            pods = list(self.pods.get(job, []))
        out = []
        for i, proc in pods:
            code = proc.poll()
            node = self.placed[job][i]
            state: dict[str, Any] = {"running": {"startedAt": "2026-12-01T18:00:00Z"}}
            if code is not None:
                exit_code = code if code >= 0 else 128 - code  # as a kubelet reports a signal
                state = {
                    "terminated": {"exitCode": exit_code, "reason": "Completed" if code == 0 else "Error"}
                }
            phase = "Running" if code is None else ("Succeeded" if code == 0 else "Failed")
            out.append(
                {
                    "metadata": {
                        "name": f"{job}-{i}-x{i}",
                        "namespace": "default",
                        "labels": {"job-name": job},
                        "annotations": {"batch.kubernetes.io/job-completion-index": str(i)},
                    },
                    "spec": {"nodeName": node, "containers": [{"name": "agent", "image": "x"}]},
                    "status": {
                        "phase": phase,
                        "reason": "NodeLost" if node in self.lost else None,
                        "containerStatuses": [
                            {"name": "agent", "ready": code is None, "restartCount": 0, "image": "x",
                             "imageID": "x", "state": state}
                        ],
                    },
                }
            )  # fmt: skip
        return out

    def lose_node(self, node: str) -> list[int]:
        """The node dies: SIGKILL to every process of its pods (agent and ranks), Ready turns Unknown."""
        self.lost.add(node)
        self.nodes[node]["status"]["conditions"] = [
            {"type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown"}
        ]
        killed = []
        for job, pods in self.pods.items():
            for i, proc in pods:
                if self.placed[job][i] == node:
                    for pid in _tree(proc.pid):
                        try:
                            os.kill(pid, signal.SIGKILL)
                            killed.append(pid)
                        except ProcessLookupError:
                            pass
                    proc.wait()
        return killed

    def patch_node(self, name: str, body: Any) -> dict[str, Any]:
        self.patches.append((name, body))
        node = self.nodes[name]
        for key in ("labels", "annotations"):
            for k, v in (body.get("metadata", {}).get(key) or {}).items():
                if v is None:
                    node["metadata"].setdefault(key, {}).pop(k, None)
                else:
                    node["metadata"].setdefault(key, {})[k] = v
        if "unschedulable" in body.get("spec", {}):
            node["spec"]["unschedulable"] = bool(body["spec"]["unschedulable"])
        return node

    def delete_job(self, name: str) -> None:
        with self._lock:
            pods = self.pods.pop(name, [])
        for _, proc in pods:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        end = time.monotonic() + 5.0
        for _, proc in pods:
            try:
                proc.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def close(self) -> None:
        for name in list(self.pods):
            self.delete_job(name)
        self.server.shutdown()
        self.server.server_close()


def _is_worker_job(job: Any) -> bool:
    labels = job.get("spec", {}).get("template", {}).get("metadata", {}).get("labels", {})
    return bool(labels.get("gpufleet.io/role") == "worker")


def write_kubeconfig(path: Any, url: str) -> None:
    """A kubeconfig whose one cluster is the fake server (for processes that load their own config)."""
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "fake", "cluster": {"server": url}}],
                "users": [{"name": "fake", "user": {"token": "fake"}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
                "current-context": "fake",
            }
        )
    )


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (by parent pid), read from /proc in one sweep."""
    from pathlib import Path

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


def _node(name: str) -> dict[str, Any]:
    return {
        "kind": "Node",
        "apiVersion": "v1",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
        "spec": {},
        "status": {"conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}]},
    }

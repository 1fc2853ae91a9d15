"""The Kubernetes backends: ``k8s`` submits a run, ``k8s-jobs`` is the supervisor inside the cluster.

``gpufleet run --backend k8s --nodes M -n K --image IMG -- python train.py`` (:class:`K8sSubmitter`)
writes the run's manifests (:mod:`gpufleet.backends.k8s.manifests`) under ``RUN_DIR/k8s/`` and, without
``--dry-run``, creates them through the official ``kubernetes`` client. Inside the cluster the
supervisor pod runs ``gpufleet run --backend k8s-jobs`` (:class:`K8sJobsBackend`): per attempt it
creates an indexed Job of M pods, each running the pod agent (:mod:`gpufleet.backends.k8s.agent`),
which reports over the TCP event channel (:mod:`gpufleet.backends.channel`). Exit codes come from the
pods' container statuses and the agents' exit reports on the shared run directory.

After a failed attempt, a pod that was evicted, lost its node, or whose node is no longer Ready marks
that node lost: ``node_lost`` in the ledger, the node cordoned and tainted through
:class:`gpufleet.backends.k8s.actions.K8sActions` (owned reason, admin cordons untouched, the circuit
breaker), and kept out of the next attempt's Job by hostname.

Written and tested without a live cluster: the agent entry runs for real in the tests, the API calls
against recorded HTTP exchanges (docs/backends/k8s.md).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from gpufleet.backends.agent import exit_report
from gpufleet.backends.base import (
    CONTINUE,
    Attempt,
    Backend,
    Blame,
    LaunchSpec,
    Submitter,
    Verdict,
    Worker,
)
from gpufleet.backends.channel import read_hello
from gpufleet.backends.process import PipeChannel
from gpufleet.core import events as E
from gpufleet.core.env import Env
from gpufleet.core.errors import ConfigError
from gpufleet.core.ledger import EventSink

__all__ = ["K8sJobsBackend", "K8sAttempt", "K8sSubmitter", "api_clients", "submit", "LOST_CODE"]

LOST_CODE = -9
JOB_ENV = "GPUFLEET_K8S_JOB"  # the K8sJob as JSON (set in the supervisor's pod spec)
_LOST_REASONS = {"NodeLost", "Evicted", "Preempting", "DeletionByTaintManager", "TerminationByKubelet"}


# ---------------------------------------------------------------------------- the cluster side
def api_clients() -> tuple[Any, Any]:
    """(BatchV1Api, CoreV1Api): in-cluster config in a pod, else the kubeconfig."""
    try:
        from kubernetes import client, config
    except ImportError:
        raise ConfigError(
            "the k8s backend needs the kubernetes client: pip install 'gpufleet[k8s]'"
        ) from None
    try:
        config.load_incluster_config()
    except config.ConfigException:
        try:
            config.load_kube_config()
        except (config.ConfigException, OSError) as e:
            raise ConfigError(
                f"no Kubernetes cluster configured ({e}); use --dry-run to only write manifests"
            ) from None
    return client.BatchV1Api(), client.CoreV1Api()


@dataclass
class _Pod:
    worker: Worker
    fd: int
    node: str
    code: int | None = None
    lost: bool = False


class K8sAttempt(Attempt):
    """Attempt A's indexed Job: its pods' exit codes from the API, its events from the agents' sockets."""

    def __init__(self, backend: K8sJobsBackend, spec: LaunchSpec, pods: list[_Pod], job_name: str):
        self.backend = backend
        self.spec = spec
        self.pods = pods
        self.workers = [p.worker for p in pods]
        self.events = PipeChannel({p.fd: p.worker.rank for p in pods})
        self.job_name = job_name
        self._polled = 0.0

    def _refresh(self, force: bool = False) -> None:
        if not force and time.monotonic() - self._polled < self.backend.poll_s:
            return
        self._polled = time.monotonic()
        statuses = self.backend.pod_statuses(self.job_name)
        for p in self.pods:
            if p.code is not None:
                continue
            st = statuses.get(p.worker.rank // self.spec.nproc_per_node)
            if st is None:
                continue
            code, lost, node = st
            if node:
                p.node = node
            if code is not None:
                report = exit_report(self.spec.env[Env.RUN_DIR], self.spec.attempt, p.node)
                own = report.get("worker_code") if report else None
                p.code = own if isinstance(own, int) and code != 0 else (LOST_CODE if lost else code)
                p.lost = lost

    def poll(self) -> dict[int, int | None]:
        self._refresh()
        return {p.worker.rank: p.code for p in self.pods}

    def _send(self, word: bytes) -> None:
        for p in self.pods:
            if p.code is None:
                try:
                    os.write(p.fd, word + b"\n")
                except OSError:
                    pass

    def request_final_checkpoint(self) -> None:
        self._send(b"USR1")

    def stop(self, grace_s: float) -> None:
        self._send(b"TERM")
        end = time.monotonic() + grace_s + 10.0
        while time.monotonic() < end and any(p.code is None for p in self.pods):
            self._refresh(force=True)
            time.sleep(0.5)
        self.backend.delete_job(self.job_name)
        for p in self.pods:
            if p.code is None:
                p.code = LOST_CODE


class K8sJobsBackend(Backend):
    """The supervisor in the cluster: one indexed Job per attempt (see the module doc)."""

    name = "k8s-jobs"
    # A pod's environment is its image's; what gpufleet forwards is written into the worker Job, so
    # only the --env variables go (backends.environ), never the supervisor pod's own (its secrets).
    inherits_environment = False

    def __init__(
        self,
        standby: bool = False,
        nodes: int | None = None,
        min_nodes: int | None = None,
        job_json: str | None = None,
        port: int | None = None,
        connect_timeout: float = 900.0,
        poll_s: float = 1.0,
        clients: tuple[Any, Any] | None = None,
    ) -> None:
        from gpufleet.backends.k8s.manifests import K8sJob

        del standby, min_nodes  # the cluster's scheduler finds a replacement node; no shrinking
        raw = job_json or Env.K8S_JOB.get()
        if not raw:
            raise ConfigError(f"the k8s-jobs backend runs in the supervisor pod (${Env.K8S_JOB} unset)")
        self.job = K8sJob.from_json(raw)
        self.want = nodes or self.job.nodes
        self.connect_timeout = connect_timeout
        self.poll_s = poll_s
        self.batch, self.core = clients or api_clients()
        self.listener = socket.create_server(
            ("", self.job.event_port if port is None else port), backlog=self.want
        )
        self.lost: list[str] = []

    def start(self, spec: LaunchSpec) -> K8sAttempt:
        from gpufleet.backends.k8s.manifests import master_addr, worker_job

        token = os.urandom(8).hex()
        spec.nnodes = self.want
        spec.master_addr, spec.master_port = master_addr(self.job, spec.attempt), self.job.master_port
        env = {k: v for k, v in spec.env.items() if k != Env.RUN_DIR}
        spec.env[Env.RUN_DIR] = self.job.run_mount  # the pods' path of the shared run directory
        body = worker_job(
            self.job,
            spec.attempt,
            env,
            token,
            nodes=self.want,
            exclude_nodes=self.lost,
            command=spec.command,
            nproc_per_node=spec.nproc_per_node,
            forward=spec.forward,
            max_restarts=spec.max_restarts,
            run_id=spec.run_id,
        )
        self.batch.create_namespaced_job(self.job.namespace, body)
        name = body["metadata"]["name"]
        pods = self._accept(token, spec.nproc_per_node)
        return K8sAttempt(self, spec, pods, name)

    def _accept(self, token: str, per: int) -> list[_Pod]:
        pods: dict[int, _Pod] = {}
        end = time.monotonic() + self.connect_timeout
        self.listener.settimeout(1.0)
        while len(pods) < self.want and time.monotonic() < end:
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            hello = read_hello(conn, 10.0)
            if len(hello) == 3 and hello[0] == token and hello[1].isdigit() and int(hello[1]) < self.want:
                i = int(hello[1])
                w = Worker(i * per, None, ranks=tuple(range(i * per, (i + 1) * per)), node=hello[2])
                pods[i] = _Pod(w, conn.detach(), hello[2])
            else:
                conn.close()
        for i in range(self.want):  # a pod that never reported: its code comes from the API (or lost)
            if i not in pods:
                r, w = os.pipe()
                os.close(w)
                pods[i] = _Pod(Worker(i * per, None, ranks=tuple(range(i * per, (i + 1) * per))), r, "")
        return [pods[i] for i in range(self.want)]

    def pod_statuses(self, job_name: str) -> dict[int, tuple[int | None, bool, str]]:
        """Completion index -> (exit code or None, lost?, node name) of the Job's pods."""
        from gpufleet.backends.k8s.manifests import LABEL_RUN

        sel = f"job-name={job_name},{LABEL_RUN}={self.job.name}"
        out: dict[int, tuple[int | None, bool, str]] = {}
        for pod in self.core.list_namespaced_pod(self.job.namespace, label_selector=sel).items:
            ann = pod.metadata.annotations or {}
            idx = int(ann.get("batch.kubernetes.io/job-completion-index", "-1"))
            node = pod.spec.node_name or ""
            reason = pod.status.reason or ""
            lost = reason in _LOST_REASONS or any(
                c.type == "DisruptionTarget" and c.status == "True" for c in (pod.status.conditions or [])
            )
            code = None
            for cs in pod.status.container_statuses or []:
                term = cs.state.terminated if cs.state else None
                if cs.name == "agent" and term is not None:
                    code = term.exit_code
            if code is None and (lost or pod.status.phase == "Failed"):
                code = LOST_CODE
            out[idx] = (code, lost, node)
        return out

    def delete_job(self, job_name: str) -> None:
        from kubernetes.client.rest import ApiException

        try:
            self.batch.delete_namespaced_job(job_name, self.job.namespace, propagation_policy="Background")
        except ApiException as e:
            if e.status != 404:
                raise

    def after_failure(self, attempt: Attempt, ledger: EventSink, blame: Blame | None = None) -> Verdict:
        """Nodes whose pods were lost, or that are no longer Ready: record, cordon, keep out."""
        assert isinstance(attempt, K8sAttempt)
        from gpufleet.backends.k8s.actions import K8sActions, node_ready

        acts = K8sActions(self.core, sink=ledger)
        for p in attempt.pods:
            if not p.node or p.node in self.lost:
                continue
            ready = node_ready(self.core, p.node)
            if p.lost or not ready:
                why = "its pod was evicted or lost" if p.lost else "the node is not Ready"
                reason = f"k8s node {p.node} lost in attempt {attempt.spec.attempt}: {why}"
                ledger.emit(E.NodeLost(node=p.node, attempt=attempt.spec.attempt, reason=reason))
                self.lost.append(p.node)
                acts.isolate(p.node, "node-lost", reason)
        return CONTINUE

    def close(self) -> None:
        self.listener.close()


# ------------------------------------------------------------------------------------ submitting
def submit(job: Any, run_dir: str | os.PathLike[str], dry_run: bool) -> tuple[list[Path], bool]:
    """Write the run's manifests under RUN_DIR/k8s; create them unless ``dry_run``. (paths, applied)."""
    from gpufleet.backends.k8s.manifests import write_manifests

    paths = write_manifests(job, Path(run_dir) / "k8s")
    if dry_run:
        return paths, False
    _, core = api_clients()
    from kubernetes import utils

    for p in paths:
        if p.name == "worker-job.json":  # the supervisor creates each attempt's Job itself
            continue
        utils.create_from_dict(core.api_client, json.loads(p.read_text()))
    return paths, True


@dataclass(frozen=True, slots=True)
class K8sSubmitter(Submitter):
    """``gpufleet run --backend k8s``: the run's objects, the supervisor inside on ``k8s-jobs``."""

    inner: ClassVar[str] = "k8s-jobs"

    name: str
    """The run's name (``--job-name``): a DNS label, prefix of every object."""
    image: str
    """The image with gpufleet and the training code (``--image``)."""
    nodes: int
    """Pods per attempt (``--nodes``)."""
    min_nodes: int | None
    """``--min-nodes``."""
    namespace: str
    """Namespace of the run's objects."""
    run_claim: str | None
    """A ReadWriteMany PVC for the run directory."""
    exclude: tuple[str, ...]
    """Nodes to keep off, besides the node state log's."""
    apply: bool
    """Create the objects (``--submit``), or only write them (``--dry-run``)."""

    @classmethod
    def from_flags(cls, flags: Mapping[str, Any]) -> K8sSubmitter:
        return cls(
            name=flags["job_name"],
            image=flags.get("image") or "",
            nodes=flags.get("nodes") or 1,
            min_nodes=flags.get("min_nodes"),
            namespace=flags.get("namespace") or "default",
            run_claim=flags.get("run_claim"),
            exclude=tuple(flags.get("exclude") or ()),
            apply=flags.get("submit", True),
        )

    def submit(
        self, command: list[str], nproc_per_node: int, run_dir: str, supervisor_flags: list[str]
    ) -> int:
        from gpufleet.backends.k8s.manifests import K8sJob
        from gpufleet.health.nodes import exclude_list

        job = K8sJob(
            name=self.name,
            image=self.image,
            command=list(command),
            nodes=self.nodes,
            nproc_per_node=nproc_per_node,
            min_nodes=self.min_nodes,
            namespace=self.namespace,
            run_claim=self.run_claim,
            supervisor_flags=supervisor_flags,
            exclude_nodes=sorted(set(exclude_list()) | set(self.exclude)),
        )
        paths, applied = submit(job, run_dir, dry_run=not self.apply)
        where = paths[0].parent
        if applied:
            print(
                f"gpufleet: created run {job.name} in namespace {job.namespace} (manifests in {where})",
                file=sys.stderr,
            )
        else:
            print(
                f"gpufleet: wrote {len(paths)} manifests to {where} (not applied; see {where}/kubectl.txt)",
                file=sys.stderr,
            )
        return 0

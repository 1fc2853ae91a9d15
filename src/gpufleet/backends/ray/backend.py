"""The Ray backend: one gpufleet node agent per Ray node, inside a Ray actor, gang-scheduled.

``gpufleet run --backend ray --address HOST:PORT --nodes M -n K -- python train.py`` runs the supervisor
as a Ray driver. Per attempt it reserves a placement group of M bundles (``STRICT_SPREAD``: one per Ray
node; ``PACK`` for one node), each asking for K CPUs (and GPUs, ``gpus_per_rank``) and K units of the
``gpufleet`` custom resource where the cluster offers it. On each bundle a small actor
(:class:`NodeAgent`) starts the same per-node agent the srun backend uses
(:mod:`gpufleet.backends.agent`), which starts that node's ranks with the local backend. Rendezvous is
torch.distributed's as everywhere else: ``MASTER_ADDR`` is the first actor's node IP, ``MASTER_PORT`` a
port that actor found free there.

Events travel over the TCP event channel (:mod:`gpufleet.backends.channel`): the supervisor listens;
each actor connects, says which node it is (one hello line), and hands the connected socket to its
agent **as its stdout**, so the agent's relayed event lines go straight to the supervisor (the srun
backend's pipe, over TCP). :class:`RayAttempt` reads them with the same
:class:`~gpufleet.backends.process.PipeChannel`.

Exit codes: each actor's ``wait()`` resolves to its agent's failed rank's own code (the srun rule). An
actor that dies (its node lost, its worker process killed) reads as -9.

Failures: :meth:`RayBackend.after_failure` finds lost nodes (the actor died or did not answer, or Ray
marks the node dead), records ``node_lost`` and a ``suspect`` node state, and keeps the node out of
the next placement groups with a label selector on ``ray.io/node-id``. A node blamed for
``node_failures`` failures in a row is excluded the same way. The world size stays what the first
attempt had: with fewer nodes left, each runs more ranks (down to ``min_nodes``), so a resumed run
ends bit-identical to an unfailed one.

Health (``gpufleet health check`` as a Ray task per node, and quarantine) lives in
:mod:`gpufleet.backends.ray.quarantine`. ``python -m gpufleet.backends.ray`` is the agent's entry
(:mod:`gpufleet.backends.ray.agent`).

Ray is imported lazily (the ``ray`` extra).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from gpufleet.backends.agent import exit_report
from gpufleet.backends.base import CONTINUE, Attempt, Backend, Blame, LaunchSpec, Verdict, Worker
from gpufleet.backends.channel import read_hello, send_hello
from gpufleet.backends.process import PipeChannel
from gpufleet.core import events as E
from gpufleet.core.env import Env, Platform
from gpufleet.core.errors import ConfigError
from gpufleet.core.ledger import EventSink

__all__ = [
    "RayBackend",
    "RayAttempt",
    "NodeAgent",
    "connect",
    "node_name",
    "quarantined",
    "RESOURCE",
    "NAMESPACE",
    "LOST_CODE",
    "QUARANTINE_PREFIX",
]

RESOURCE = "gpufleet"  # the custom resource gpufleet's bundles ask for; a quarantine holds all of a node's
NAMESPACE = "gpufleet"  # Ray namespace of gpufleet's named actors (the quarantine holds)
LOST_CODE = -9  # exit code of a worker whose actor died: it reads as killed
QUARANTINE_PREFIX = "gpufleet-quarantine-"  # a quarantine hold's actor name: this + the node id
_NODE_LABEL = "ray.io/node-id"


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError("the ray backend needs Ray: pip install 'gpufleet[ray]'") from None
    return ray


def connect(address: str | None = None) -> bool:
    """Join the Ray cluster at ``address`` (else ``$RAY_ADDRESS``, else ``auto``) unless already joined.

    True when this call connected (so the caller may disconnect).
    """
    ray = _ray()
    if ray.is_initialized():
        return False
    import logging

    target = address or Platform.RAY_ADDRESS.get() or "auto"
    _reachable(target)
    try:
        ray.init(
            address=target,
            namespace=NAMESPACE,
            logging_level=logging.ERROR,
            log_to_driver=False,
            configure_logging=False,
        )
    except (ConnectionError, ValueError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"cannot join the Ray cluster at {address or 'auto'}: {first}") from None
    return True


def _reachable(address: str, timeout: float = 5.0) -> None:
    """Fail fast (one line) when HOST:PORT does not accept a connection: ray.init would retry for minutes."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        if address != "auto":
            raise ConfigError(f"--address {address!r} is not HOST:PORT (or auto)")
        return
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as e:
        raise ConfigError(f"cannot reach the Ray cluster at {address}: {e.strerror or e}") from None


def node_name(node_id: str) -> str:
    """How gpufleet names a Ray node in ledgers: the first 12 hex digits of its node id."""
    return node_id[:12]


def _alive_nodes(resource: str | None) -> list[dict[str, Any]]:
    """Alive Ray nodes that can run workers: with ``resource`` (when given), else with CPUs."""
    out = []
    for n in _ray().nodes():
        if not n.get("Alive"):
            continue
        res = n.get("Resources", {})
        if (res.get(resource, 0) > 0) if resource else (res.get("CPU", 0) > 0):
            out.append(n)
    return out


# ------------------------------------------------------------------------------------- the actor
class NodeAgent:
    """Runs on one Ray node (one placement-group bundle): starts and watches that node's agent."""

    def __init__(self) -> None:
        import threading

        self.proc: subprocess.Popen[bytes] | None = None
        self.launched = threading.Event()  # calls run concurrently: wait() must not beat launch()
        self.run_dir = ""
        self.attempt = 0
        self.node = ""

    def where(self, want_port: bool = False) -> dict[str, Any]:
        """This node's id and IP, and (``want_port``) a TCP port free on it for the rendezvous."""
        ray = _ray()
        ip = ray.util.get_node_ip_address()
        out: dict[str, Any] = {"node_id": ray.get_runtime_context().get_node_id(), "ip": ip}
        if want_port:
            from gpufleet.core.ports import free_port

            out["port"] = free_port(ip)
        return out

    def launch(self, spec_json: str, channel: tuple[str, int], hello: str, grace_s: float) -> int:
        """Connect to the supervisor's channel, then start the agent with that socket as its stdout."""
        spec = json.loads(spec_json)
        self.run_dir, self.attempt = spec["env"][Env.RUN_DIR], spec["attempt"]
        self.node = node_name(_ray().get_runtime_context().get_node_id())
        try:
            return self._launch(spec_json, channel, hello, grace_s)
        finally:
            self.launched.set()

    def _launch(self, spec_json: str, channel: tuple[str, int], hello: str, grace_s: float) -> int:
        spec = json.loads(spec_json)
        log_dir = Path(spec["log_dir"] or os.path.join(self.run_dir, "logs")) / f"attempt-{self.attempt}"
        log_dir.mkdir(parents=True, exist_ok=True)
        # The launch's environment (spec.forward) goes into the agent's own, not into its spec: the
        # ranks inherit it from there, over this node's own variables.
        forward = spec.pop("forward", None) or {}
        env = {
            **os.environ,
            **forward,
            **spec["env"],
            Env.AGENT_SPEC: json.dumps(spec),
            Env.AGENT_GRACE: Env.AGENT_GRACE.format(grace_s),
            Env.NODE: self.node,
        }
        sock = socket.create_connection(channel, timeout=30)
        try:
            send_hello(sock, *hello.split())
            sock.setblocking(True)
            with open(log_dir / f"agent-{self.node}.log", "ab") as err:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "gpufleet.backends.ray"],
                    stdin=subprocess.DEVNULL,
                    stdout=sock.fileno(),
                    stderr=err,
                    env=env,
                    start_new_session=True,
                )
        finally:
            sock.close()  # the agent holds the connection now
        return self.proc.pid

    def wait(self) -> int:
        """The agent's exit code once it exits: its failed rank's own code (-N for signal N), or 0."""
        self.launched.wait()
        if self.proc is None:
            return LOST_CODE
        code = self.proc.wait()
        report = exit_report(self.run_dir, self.attempt, self.node)
        own = report.get("worker_code") if report else None
        return own if isinstance(own, int) and code != 0 else code

    def signal(self, signum: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.send_signal(signum)
            except ProcessLookupError:
                pass

    def stop(self, grace_s: float) -> None:
        """SIGTERM the agent (it stops its ranks within its own grace), SIGKILL after ``grace_s``."""
        if self.proc is None:
            return
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.proc.wait()


# ---------------------------------------------------------------------------------- the attempt
@dataclass
class _Node:
    actor: Any
    worker: Worker
    node_id: str
    ip: str
    wait_ref: Any = None
    code: int | None = None
    unreachable: bool = False  # its actor died or did not answer: a node-loss suspect


class RayAttempt(Attempt):
    """The actors of one attempt, their agents' exit codes and the TCP event channel."""

    def __init__(
        self, spec: LaunchSpec, nodes: list[_Node], channel: PipeChannel, pg: Any, agent_grace_s: float
    ):
        self.spec = spec
        self.nodes = nodes
        self.workers = [n.worker for n in nodes]
        self.events = channel
        self.pg = pg
        self.agent_grace_s = agent_grace_s
        self._released = False

    def _settle(self, n: _Node, timeout: float) -> None:
        ray = _ray()
        if n.code is not None or n.wait_ref is None:
            return
        ready, _ = ray.wait([n.wait_ref], timeout=timeout)
        if not ready:
            return
        try:
            n.code = int(ray.get(n.wait_ref))
        except Exception:  # the actor died (RayActorError and kin): its node or its process is gone
            n.code, n.unreachable = LOST_CODE, True

    def poll(self) -> dict[int, int | None]:
        for n in self.nodes:
            self._settle(n, 0)
        return {n.worker.rank: n.code for n in self.nodes}

    def request_final_checkpoint(self) -> None:
        for n in self.nodes:
            if n.code is None:
                n.actor.signal.remote(int(signal.SIGUSR1))

    def stop(self, grace_s: float) -> None:
        ray = _ray()
        live = [n for n in self.nodes if n.code is None]
        refs = {n.worker.rank: n.actor.stop.remote(grace_s + self.agent_grace_s) for n in live}
        deadline = time.monotonic() + grace_s + self.agent_grace_s + 10.0
        for n in live:
            try:
                ray.get(refs[n.worker.rank], timeout=max(0.1, deadline - time.monotonic()))
            except Exception:  # dead or unresponsive actor: its node is a loss suspect
                n.unreachable = True
            self._settle(n, 1.0 if not n.unreachable else 0)
            if n.code is None:
                n.code, n.unreachable = LOST_CODE, True
        self.release()

    def release(self) -> None:
        """Kill the actors and give the placement group back (after stop)."""
        if self._released:
            return
        self._released = True
        ray = _ray()
        for n in self.nodes:
            try:
                ray.kill(n.actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead, or its node is gone: nothing left to release
                pass
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.pg)
            except Exception:  # noqa: BLE001 - cluster gone or group already removed: best-effort release
                pass

    def close(self) -> None:
        super().close()
        if all(n.code is not None for n in self.nodes):
            self.release()


# ---------------------------------------------------------------------------------- the backend
class RayBackend(Backend):
    """Workers on a Ray cluster: a placement group per attempt, an agent per node (see module doc)."""

    name = "ray"

    @classmethod
    def options(cls, flags: Mapping[str, Any]) -> dict[str, Any]:
        return {"address": flags["address"], "nodes": flags["nodes"], "min_nodes": flags["min_nodes"]}

    def __init__(
        self,
        standby: bool = False,
        address: str | None = None,
        nodes: int | None = None,
        min_nodes: int | None = None,
        cpus_per_rank: float = 1.0,
        gpus_per_rank: float = 0.0,
        resource: str = RESOURCE,
        node_failures: int = 2,
        placement_timeout: float = 60.0,
        launch_timeout: float = 120.0,
        agent_grace_s: float = Env.AGENT_GRACE.default,
        probe_timeout: float = 5.0,
    ) -> None:
        del standby  # no standby interpreters across Ray nodes (each attempt starts fresh agents)
        self.want = nodes or 1
        self.min_nodes = min_nodes or 1
        if not 1 <= self.min_nodes <= self.want:
            raise ConfigError(f"need 1 <= --min-nodes ({self.min_nodes}) <= --nodes ({self.want})")
        if node_failures < 1 or cpus_per_rank < 0 or gpus_per_rank < 0:
            raise ConfigError("node_failures must be >= 1 and cpus/gpus per rank >= 0")
        self.cpus_per_rank = cpus_per_rank
        self.gpus_per_rank = gpus_per_rank
        self.node_failures = node_failures
        self.placement_timeout = placement_timeout
        self.launch_timeout = launch_timeout
        self.agent_grace_s = agent_grace_s
        self.probe_timeout = probe_timeout
        self._owns_connection = connect(address)
        # The custom resource only where the cluster offers it: else bundles ask for CPUs alone.
        self.resource: str | None = resource if _alive_nodes(resource) else None
        if not _alive_nodes(self.resource):
            raise ConfigError(f"the Ray cluster at {address or 'auto'} has no node to run workers on")
        self.world: int | None = None  # fixed by the first attempt: fewer nodes run more ranks each
        self.excluded: dict[str, str] = {}  # node id -> why (lost, or failed node_failures times in a row)
        self.failures: dict[str, int] = {}  # node id -> consecutive failures blamed on it
        self.lost: list[str] = []

    # -- placement -------------------------------------------------------------------------------
    def eligible(self) -> list[str]:
        """Ids of alive nodes new placement groups may use: not excluded, not quarantined."""
        held = quarantined()
        ids = [n["NodeID"] for n in _alive_nodes(self.resource)]
        return [i for i in ids if i not in self.excluded and i not in held]

    def layouts(self, world: int, available: int) -> list[int]:
        """Node counts to try, most first: divisors of the world size in [min_nodes, nodes]."""
        top = min(self.want, available)
        return [m for m in range(top, self.min_nodes - 1, -1) if world % m == 0]

    def _bundles(self, m: int, per_node: int) -> tuple[list[dict[str, float]], list[dict[str, str]] | None]:
        b: dict[str, float] = {"CPU": self.cpus_per_rank * per_node}
        if self.gpus_per_rank:
            b["GPU"] = self.gpus_per_rank * per_node
        if self.resource:
            b[self.resource] = float(per_node)
        selector = None
        if self.excluded:
            selector = [{_NODE_LABEL: f"!in({','.join(sorted(self.excluded))})"} for _ in range(m)]
        return [dict(b) for _ in range(m)], selector

    def _place(self, world: int) -> tuple[Any, int]:
        ray = _ray()
        from ray.util.placement_group import placement_group, remove_placement_group

        eligible = len(self.eligible())
        tried = []
        for m in self.layouts(world, eligible):
            bundles, selector = self._bundles(m, world // m)
            pg = placement_group(
                bundles, strategy="STRICT_SPREAD" if m > 1 else "PACK", bundle_label_selector=selector
            )
            ready, _ = ray.wait([pg.ready()], timeout=self.placement_timeout)
            if ready:
                return pg, m
            remove_placement_group(pg)
            tried.append(f"{m}x{bundles[0]}")
        raise ConfigError(
            f"cannot place {world} rank(s) on the Ray cluster ({eligible} eligible node(s); "
            f"tried {', '.join(tried) or 'nothing'}; excluded: {self._excluded_names()})"
        )

    # -- Backend hooks ---------------------------------------------------------------------------
    def start(self, spec: LaunchSpec) -> RayAttempt:
        ray = _ray()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if self.world is None:
            self.world = self.want * spec.nproc_per_node
        pg, m = self._place(self.world)
        spec.nnodes, spec.nproc_per_node = m, self.world // m
        per = spec.nproc_per_node
        res = {self.resource: float(per)} if self.resource else {}
        cls = ray.remote(NodeAgent)
        actors = [
            cls.options(
                num_cpus=self.cpus_per_rank * per,
                num_gpus=self.gpus_per_rank * per,
                resources=res,
                max_concurrency=4,  # wait() blocks; signal()/stop() must still get through
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
            ).remote()
            for i in range(m)
        ]
        where = ray.get([a.where.remote(want_port=(i == 0)) for i, a in enumerate(actors)])
        spec.master_addr, spec.master_port = where[0]["ip"], where[0]["port"]
        run_dir = spec.env[Env.RUN_DIR]
        if spec.log_dir is None:
            spec.log_dir = os.path.join(run_dir, "logs")

        listener = socket.create_server((ray.util.get_node_ip_address(), 0), backlog=m)
        channel_addr = listener.getsockname()[:2]
        token = os.urandom(8).hex()
        nodes: list[_Node] = []
        launches = []
        for i, (a, w) in enumerate(zip(actors, where, strict=True)):
            first = i * per
            worker = Worker(first, None, ranks=tuple(range(first, first + per)), node=node_name(w["node_id"]))
            nodes.append(_Node(a, worker, w["node_id"], w["ip"]))
            sub = json.dumps(asdict(replace(spec, node_rank=i)))
            launches.append(a.launch.remote(sub, channel_addr, f"{token} {i}", self.agent_grace_s))
        fds = self._accept(listener, token, nodes, launches)
        for i, n in enumerate(nodes):
            try:
                pid = int(ray.get(launches[i], timeout=30)) if n.code is None else None
            except Exception:
                pid = None
            if n.code is None:
                n.worker = replace(n.worker, pid=pid)
                n.wait_ref = n.actor.wait.remote()
        return RayAttempt(spec, nodes, PipeChannel(fds), pg, self.agent_grace_s)

    def _accept(
        self, listener: socket.socket, token: str, nodes: list[_Node], launches: list[Any]
    ) -> dict[int, int]:
        """Each node's connected event socket (fd -> its first rank); a node whose launch failed is lost."""
        ray = _ray()
        fds: dict[int, int] = {}
        pending = set(range(len(nodes)))
        deadline = time.monotonic() + self.launch_timeout
        listener.settimeout(0.5)
        try:
            while pending and time.monotonic() < deadline:
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    conn = None
                if conn is not None:
                    hello = read_hello(conn, 5.0)
                    if len(hello) == 2 and hello[0] == token and int(hello[1]) in pending:
                        i = int(hello[1])
                        pending.discard(i)
                        fds[conn.detach()] = nodes[i].worker.rank
                    else:
                        conn.close()
                for i in list(pending):  # a launch that failed will never connect
                    done, _ = ray.wait([launches[i]], timeout=0)
                    if done:
                        try:
                            ray.get(launches[i])
                        except Exception:
                            nodes[i].code, nodes[i].unreachable = LOST_CODE, True
                            pending.discard(i)
        finally:
            listener.close()
        for i in pending:
            nodes[i].code, nodes[i].unreachable = LOST_CODE, True
        return fds

    def after_failure(self, attempt: Attempt, ledger: EventSink, blame: Blame | None = None) -> Verdict:
        """Exclude lost nodes and nodes that keep failing; restart if the world still fits somewhere."""
        assert isinstance(attempt, RayAttempt)
        number = attempt.spec.attempt
        alive = {n["NodeID"] for n in _ray().nodes() if n.get("Alive")}
        lost = [n for n in attempt.nodes if n.unreachable or n.node_id not in alive]
        lost = [n for n in lost if n.node_id not in alive or not self._answers(n.node_id)]
        for n in lost:
            name = node_name(n.node_id)
            why = (
                "Ray marks the node dead"
                if n.node_id not in alive
                else "its actor died and a probe task failed"
            )
            reason = f"ray node {name} ({n.ip}) lost in attempt {number}: {why}"
            ledger.emit(E.NodeLost(node=name, attempt=number, reason=reason))
            self._exclude(n.node_id, reason, ledger, check="node-lost")
            self.lost.append(name)
        if not lost and blame is not None:  # a node loss explains the other nodes' failures
            hit = next((n for n in attempt.nodes if blame.rank in n.worker.ranks), None)
            for n in attempt.nodes:
                self.failures[n.node_id] = self.failures.get(n.node_id, 0) + 1 if n is hit else 0
            if hit is not None and self.failures[hit.node_id] >= self.node_failures:
                count = self.failures[hit.node_id]
                reason = f"ray node {node_name(hit.node_id)} blamed for {count} failures in a row"
                self._exclude(hit.node_id, reason, ledger, check="node-failures")
        eligible = len(self.eligible())
        if self.world is not None and self.layouts(self.world, eligible):
            return CONTINUE
        return Verdict(
            restart=False,
            reason=f"{eligible} eligible Ray node(s) left; {self.world} rank(s) need {self.min_nodes} to "
            f"{self.want} node(s) (excluded: {self._excluded_names()})",
        )

    def _excluded_names(self) -> str:
        return ", ".join(map(node_name, self.excluded)) or "none"

    def _answers(self, node_id: str) -> bool:
        """True when a trivial task pinned to ``node_id`` runs within the probe timeout."""
        ray = _ray()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        probe = ray.remote(num_cpus=0)(_probe).options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
        )
        try:
            return bool(ray.get(probe.remote(), timeout=self.probe_timeout) == node_id)
        except Exception:
            return False

    def _exclude(self, node_id: str, reason: str, ledger: EventSink, check: str) -> None:
        from gpufleet.health.nodes import record_state

        self.excluded[node_id] = reason
        name = node_name(node_id)
        ledger.emit(
            E.NodeState(
                node=name,
                state=E.NodeStateName.SUSPECT,
                reason=reason,
                component=E.Component.HOST,
                check=check,
            )
        )
        record_state(name, "suspect", reason, component="host", check=check)
        print(f"gpufleet: excluding Ray node {name}: {reason}", file=sys.stderr)

    def close(self) -> None:
        if self._owns_connection:
            _ray().shutdown()
            self._owns_connection = False


def quarantined() -> dict[str, str]:
    """Node id -> hold actor name, for every node gpufleet quarantined (:mod:`.quarantine` holds and
    releases them; placement leaves them out)."""
    out = {}
    for a in _ray().util.list_named_actors(all_namespaces=True):
        name = a["name"] if isinstance(a, dict) else str(a)
        if name.startswith(QUARANTINE_PREFIX):
            out[name[len(QUARANTINE_PREFIX) :]] = name
    return out


def _probe() -> str:
    return str(_ray().get_runtime_context().get_node_id())

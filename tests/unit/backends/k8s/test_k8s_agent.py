"""The worker pod's entry (`python -m gpufleet.backends.k8s`), run for real as a process on this host.

What a pod does in the cluster, minus the cluster: connect to the supervisor's event port, say hello
(token, node rank from JOB_COMPLETION_INDEX, node name), relay its ranks' events on that connection,
and obey the supervisor's requests sent back on it (USR1: final checkpoint; a closed connection: stop).
The preStop hook asks PID 1 (here: the agent's pid) for a final checkpoint and waits for its exit report.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from gpufleet.backends import LaunchSpec
from gpufleet.backends.agent import exit_report
from gpufleet.backends.k8s.agent import prestop
from gpufleet.backends.process import PipeChannel

WORKER = r"""
import json, os, signal, sys, time
out = sys.argv[1]
rank = int(os.environ["RANK"])
fd = int(os.environ["GPUFLEET_CONTROL_FD"])
asked = []
signal.signal(signal.SIGUSR1, lambda *a: asked.append(1))
ev = {"ev": "armed", "rank": rank, "t": time.time(), "pid": os.getpid()}
os.write(fd, (json.dumps(ev) + "\n").encode())
while not asked:
    time.sleep(0.01)
open(os.path.join(out, f"final-{rank}"), "w").write("checkpointed")
"""


def start_agent(tmp: Path, index: int = 1) -> tuple[subprocess.Popen[bytes], socket.socket, str]:
    script = tmp / "worker.py"
    script.write_text(WORKER)
    (tmp / "run").mkdir(exist_ok=True)
    spec = LaunchSpec(
        command=[sys.executable, str(script), str(tmp)],
        nproc_per_node=2,
        env={"GPUFLEET_RUN_DIR": str(tmp / "run")},
        nnodes=2,
        log_dir=str(tmp / "logs"),
    )
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(60)
    env = {
        **os.environ,
        "GPUFLEET_AGENT_SPEC": json.dumps(asdict(spec)),
        "GPUFLEET_K8S_CHANNEL": f"127.0.0.1:{listener.getsockname()[1]} tok3n",
        "GPUFLEET_AGENT_GRACE": "1",
        "JOB_COMPLETION_INDEX": str(index),
        "GPUFLEET_NODE": "gpu-node-b",
    }
    argv = [sys.executable, "-m", "gpufleet.backends.k8s"]
    proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL)
    conn, _ = listener.accept()
    listener.close()
    return proc, conn, "gpu-node-b"


def hello(conn: socket.socket) -> str:
    buf = b""
    while not buf.endswith(b"\n"):
        buf += conn.recv(1)
    return buf.decode().strip()


def armed(channel: PipeChannel, count: int) -> list[dict]:
    got: list[dict] = []
    end = time.monotonic() + 60
    while len(got) < count and time.monotonic() < end:
        got += [e for e in channel.read(0.1) if e.get("ev") == "armed"]
    assert len(got) == count, got
    return got


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def agent(tmp_path):
    proc, conn, node = start_agent(tmp_path)
    yield proc, conn, node, tmp_path
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_hello_events_and_final_checkpoint_request_over_one_connection(agent):
    proc, conn, node, tmp = agent
    assert hello(conn) == f"tok3n 1 {node}"  # node rank 1 from JOB_COMPLETION_INDEX
    fd = conn.detach()
    channel = PipeChannel({fd: 2})
    got = armed(channel, 2)
    assert sorted(e["rank"] for e in got) == [2, 3]  # node rank 1 of 2 nodes x 2 ranks
    os.write(fd, b"USR1\n")  # the supervisor's final-checkpoint request, on the same connection
    assert proc.wait(timeout=60) == 0
    assert sorted(p.name for p in tmp.glob("final-*")) == ["final-2", "final-3"]
    report = exit_report(tmp / "run", 0, node)
    assert report is not None and report["code"] == 0
    channel.close()


def test_a_closed_channel_stops_the_agent_and_its_ranks(agent):
    proc, conn, node, tmp = agent
    hello(conn)
    channel = PipeChannel({conn.detach(): 2})
    pids = [e["pid"] for e in armed(channel, 2)]
    channel.close()  # the supervisor is gone
    assert proc.wait(timeout=60) == 143  # stopped, as on SIGTERM
    assert not [p for p in pids if alive(p)]
    assert not list(tmp.glob("final-*"))


def test_prestop_asks_for_the_final_checkpoint_and_waits_for_it(agent, monkeypatch):
    proc, conn, node, tmp = agent
    hello(conn)
    channel = PipeChannel({conn.detach(): 2})
    armed(channel, 2)
    pod_spec = {"env": {"GPUFLEET_RUN_DIR": str(tmp / "run")}, "attempt": 0}  # what the pod's env holds
    monkeypatch.setenv("GPUFLEET_AGENT_SPEC", json.dumps(pod_spec))
    monkeypatch.setenv("GPUFLEET_NODE", node)
    assert prestop(60, pid=proc.pid) == 0  # returns once the agent wrote its exit report
    assert exit_report(tmp / "run", 0, node) is not None
    assert proc.wait(timeout=60) == 0 and len(list(tmp.glob("final-*"))) == 2
    channel.close()

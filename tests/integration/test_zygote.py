"""The warm interpreter (train/zygote.py, backends/zygote.py): standbys forked from one import of
torch, their exit codes relayed as ``Popen`` gives them, cancelled requests never run, the store host's
ports, and a zygote killed from outside leaves no caller waiting."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from pathlib import Path

import pytest

from gpufleet.backends.zygote import Zygote
from gpufleet.core.errors import SupervisorError

SCRIPT = """
import json, os, sys, torch
json.dump({"rank": os.environ.get("RANK"), "mine": os.environ.get("MINE"), "pid": os.getpid(),
           "sid": os.getsid(0), "nvml": os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")},
          open(sys.argv[1], "w"))
sys.exit(int(sys.argv[2]))
"""


def _order(script: Path, out: Path, code: int) -> bytes:
    return (json.dumps({"env": {"RANK": "1"}, "argv": [str(script), str(out), str(code)]}) + "\n").encode()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_standbys_run_with_their_environment_and_their_exit_codes_are_relayed(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    zygote = Zygote(sys.executable, dict(os.environ), store=True)
    r, w = os.pipe()
    try:
        port = _free_port()
        zygote.open_store("127.0.0.1", port, 2)
        other = Zygote(sys.executable, dict(os.environ), store=True)
        try:
            with pytest.raises(SupervisorError, match=f"127.0.0.1:{port}"):  # a second server on the port
                other.open_store("127.0.0.1", port, 2)
        finally:
            other.close()
        zygote.open_store("127.0.0.1", port, 2)  # the last one closed first: the same port again
        env = {**os.environ, "MINE": "yes", "GPUFLEET_CONTROL_FD": str(w)}
        exits = zygote.fork(env, w, eager=True)
        killed = zygote.fork(env, w, eager=True)
        cancelled = zygote.fork(env, w, eager=False)
        cancelled.cancel()  # asked for while the zygote imports: never made
        assert cancelled.poll() == -signal.SIGTERM and not cancelled.forked
        assert exits.stdin is not None and killed.stdin is not None
        exits.stdin.write(_order(script, tmp_path / "exits.json", 3))
        exits.stdin.close()
        assert exits.wait(timeout=120) == 3
        seen = json.loads((tmp_path / "exits.json").read_text())
        assert seen["rank"] == "1" and seen["mine"] == "yes" and seen["pid"] == exits.pid
        assert seen["nvml"] is None  # the zygote's own switch stays the zygote's
        assert seen["sid"] == exits.pid  # a session of its own: the backend signals its process group
        os.killpg(killed.pid, signal.SIGKILL)
        assert killed.wait(timeout=60) == -signal.SIGKILL
    finally:
        zygote.close()
        os.close(r)
        os.close(w)
    assert zygote.proc.poll() is not None


def test_a_zygote_killed_from_outside_leaves_no_caller_waiting(tmp_path: Path) -> None:
    zygote = Zygote(sys.executable, dict(os.environ), store=False)
    r, w = os.pipe()
    try:
        waiting = zygote.fork(dict(os.environ), w, eager=True)
        zygote.proc.kill()
        assert waiting.wait(timeout=60) == -signal.SIGKILL  # never made, and said so
        assert not zygote.alive()
        assert waiting.stdin is not None
        waiting.stdin.close()  # had it been made before the kill, it ends at this EOF
    finally:
        zygote.close()
        os.close(r)
        os.close(w)

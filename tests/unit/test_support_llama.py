"""The llama.cpp test service fails at once, with a clear message, when its server dies.

A stand-in server process answers ``GET /v1/models`` like llama_cpp.server and dies by SIGILL on the
first completion, as a llama.cpp built for another CPU does on its first multi-token prompt."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support import llama
from support.llama import LlamaServer, server_gone

DIES_ON_PROMPT = r"""
import json, os, signal, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

class H(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"data": [{"id": "smollm2"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        print("prompt received", flush=True)
        os.kill(os.getpid(), signal.SIGILL)

HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


class DiesOnPrompt(LlamaServer):
    def command(self) -> list[str]:
        return [sys.executable, "-c", DIES_ON_PROMPT, str(self.port)]


def test_a_server_that_dies_on_the_first_prompt_fails_start_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(llama, "llama_available", lambda: None)  # the stand-in needs no llama_cpp
    model = tmp_path / "model.gguf"
    model.write_bytes(b"")
    server = DiesOnPrompt(model, log_dir=tmp_path, ready_timeout_s=60.0)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as e:
        server.start()
    assert time.monotonic() - t0 < 30.0  # not the 60 s ready timeout
    msg = str(e.value)
    assert "killed by SIGILL (exit code -4)" in msg and "built for another CPU" in msg, msg
    assert "prompt received" in msg  # the tail of the server's log
    assert server.pid is None  # stopped and reaped


def test_server_gone_names_a_dead_pid_and_shows_its_log(tmp_path: Path) -> None:
    log = tmp_path / "llama.log"
    log.write_text("llama_model_loader: loaded\n")
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    msg = server_gone(proc.pid, log)
    assert msg is not None and f"pid {proc.pid}" in msg and "llama_model_loader: loaded" in msg
    assert server_gone(os.getpid(), log) is None

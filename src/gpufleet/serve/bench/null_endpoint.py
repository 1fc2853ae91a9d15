"""A null OpenAI endpoint: answers every POST at once with a tiny SSE stream (2 tokens + usage).

It measures the *client*: ``gpufleet serve bench --calibrate`` drives it to find the highest rate
the client sustains. Plain asyncio protocol, HTTP/1.1 keep-alive, Content-Length bodies, pre-forked
workers sharing one listening socket. Not a mock of a model server (that is ``serve mock``).

    python -m gpufleet.serve.bench.null_endpoint --port 0 --workers 1
    # prints "null endpoint listening on http://127.0.0.1:PORT" and serves until killed
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

__all__ = ["NullEndpoint", "start_null_endpoint", "serve"]

_CHUNK = 'data: {"choices":[{"index":0,"delta":{"content":"%s"},"finish_reason":%s}]}\n\n'
_BODY = (
    'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    + _CHUNK % ("hi", "null")
    + _CHUNK % (" there", '"length"')
    + 'data: {"choices":[],"usage":{"prompt_tokens":8,"completion_tokens":2,"total_tokens":10}}\n\n'
    + "data: [DONE]\n\n"
).encode()
_RESPONSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n"
    b"Connection: keep-alive\r\n\r\n" % len(_BODY)
) + _BODY
_MODELS_BODY = b'{"object":"list","data":[{"id":"null","object":"model"}]}'
_MODELS = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(_MODELS_BODY)
) + _MODELS_BODY


class _Proto(asyncio.Protocol):
    def __init__(self) -> None:
        self.buf = b""
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:  # uvloop's transports are not asyncio's classes
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        out = []
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                break
            head = self.buf[:end]
            length = 0
            i = head.lower().find(b"content-length:")
            if i >= 0:
                length = int(head[i + 15 :].split(b"\r\n", 1)[0].strip() or 0)
            if len(self.buf) < end + 4 + length:
                break
            self.buf = self.buf[end + 4 + length :]
            out.append(_MODELS if head.startswith(b"GET") else _RESPONSE)
        if out and self.transport is not None:
            self.transport.write(b"".join(out))


async def _serve_sock(sock: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Proto, sock=sock, backlog=4096)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def _run(sock: socket.socket) -> None:
    try:
        import uvloop  # optional: faster loop

        uvloop.run(_serve_sock(sock))
    except ImportError:
        asyncio.run(_serve_sock(sock))


def serve(host: str = "127.0.0.1", port: int = 0, workers: int = 1) -> None:
    """Bind, print the URL line, fork ``workers - 1`` more processes, serve until SIGTERM/SIGINT."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(4096)
    sock.setblocking(False)
    print(f"null endpoint listening on http://{host}:{sock.getsockname()[1]}", flush=True)
    children = []
    for _ in range(max(0, workers - 1)):
        pid = os.fork()
        if pid == 0:
            _run(sock)
            os._exit(0)
        children.append(pid)
    try:
        _run(sock)
    finally:
        for pid in children:
            try:
                os.kill(pid, signal.SIGTERM)
                os.waitpid(pid, 0)
            except ProcessLookupError:
                pass


@dataclass
class NullEndpoint:
    """A null endpoint running in a child process; ``stop()`` (or ``with``) ends it."""

    proc: subprocess.Popen[str]
    url: str

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> NullEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


_MODULE = "gpufleet.serve.bench.null_endpoint"


def start_null_endpoint(workers: int = 1, host: str = "127.0.0.1") -> NullEndpoint:
    """Start ``python -m gpufleet.serve.bench.null_endpoint`` on a free port and wait for its URL."""
    proc = subprocess.Popen(
        [sys.executable, "-m", _MODULE, "--host", host, "--workers", str(workers)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "http://" not in line:
        proc.kill()
        raise RuntimeError(f"null endpoint did not start: {line!r}")
    return NullEndpoint(proc, line.strip().rsplit(" ", 1)[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--workers", type=int, default=1)
    a = p.parse_args()
    serve(a.host, a.port, a.workers)


if __name__ == "__main__":
    main()

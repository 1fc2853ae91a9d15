"""A small HTTP reverse proxy that fails a deterministic fraction of S3 requests.

Run it as its own process, in front of an S3 server::

    python -m support.flaky_proxy --upstream http://127.0.0.1:8333 --error-rate 0.2 --seed 1

It prints ``PORT <n>`` on its first stdout line. Each request is either forwarded unchanged (the
Host header too, so SigV4 signatures still verify) or, with probability ``--error-rate`` drawn
from a seeded RNG, answered with ``503 SlowDown`` or ``500 InternalError`` and an S3 XML error body
after the request body has been read. Bodies are streamed both ways. With ``--cut-rate``, that
fraction of the forwarded object GETs (not listings) with a body of 2 bytes or more (drawn from a
second seeded RNG) send their headers and half of the body, then close the connection: a transfer
broken mid-body.

``GET /__proxy__/stats`` returns counters as JSON and ``GET /__proxy__/log`` the request log
(method, path, Range header, status, injected, cut, start and end times), which tests use to
check ordering and retries. These two paths are never failed. :class:`FlakyProxy` starts and
stops the process from Python.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from .process import ChildService, child_env

__all__ = ["FlakyProxy", "serve"]

_CHUNK = 1024 * 1024
_HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade"}
_ERRORS = [
    (503, "SlowDown", "Please reduce your request rate."),
    (500, "InternalError", "We encountered an internal error. Please try again."),
]


class _State:
    def __init__(self, upstream: str, error_rate: float, seed: int, cut_rate: float = 0.0) -> None:
        u = urlsplit(upstream)
        if u.scheme != "http" or not u.hostname:
            raise SystemExit(f"--upstream must be http://host:port, got {upstream!r}")
        self.host, self.port = u.hostname, u.port or 80
        self.error_rate = error_rate
        self.rng = random.Random(seed)
        self.cut_rate = cut_rate
        self.cut_rng = random.Random(seed + 7919)  # its own stream: error_rate's sequence is unchanged
        self.lock = threading.Lock()
        self.counts = {
            "requests": 0,
            "forwarded": 0,
            "injected": 0,
            "injected_503": 0,
            "injected_500": 0,
            "cut": 0,
        }
        self.log: list[dict[str, Any]] = []

    def decide(self) -> tuple[int, str, str] | None:
        with self.lock:
            self.counts["requests"] += 1
            if self.rng.random() < self.error_rate:
                err = _ERRORS[self.rng.randrange(len(_ERRORS))]
                self.counts["injected"] += 1
                self.counts[f"injected_{err[0]}"] += 1
                return err
            self.counts["forwarded"] += 1
            return None

    def decide_cut(self) -> bool:
        with self.lock:
            cut = self.cut_rate > 0 and self.cut_rng.random() < self.cut_rate
            self.counts["cut"] += cut
            return cut


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass

    def _body_chunks(self):  # noqa: ANN202 - yields the request body in chunks
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return
                yield self.rfile.read(size)
                self.rfile.readline()
        remaining = int(self.headers.get("Content-Length") or 0)
        while remaining > 0:
            chunk = self.rfile.read(min(_CHUNK, remaining))
            if not chunk:
                return
            remaining -= len(chunk)
            yield chunk

    def _write(self, data: bytes | None = None) -> None:
        """Send the headers (``None``) or body bytes, noting the time first: the client cannot hold a
        complete response before its last write began, so the log's ``end`` precedes, by cause and
        effect, any request the client sends after it."""
        self._last_write = time.time()
        if data is None:
            self.end_headers()
        else:
            self.wfile.write(data)

    def _send(self, status: int, body: bytes, ctype: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self._write()
        if self.command != "HEAD":
            self._write(body)

    def _handle(self) -> None:
        st = self.server.state
        if self.path.startswith("/__proxy__/"):
            with st.lock:
                doc = st.counts if self.path == "/__proxy__/stats" else st.log
                body = json.dumps(doc).encode()
            self._send(200, body, "application/json")
            return
        start = self._last_write = time.time()
        self._cut = False
        err = st.decide()
        if err is not None:
            for _ in self._body_chunks():
                pass
            status, code, message = err
            xml = (
                '<?xml version="1.0" encoding="UTF-8"?>\n'
                f"<Error><Code>{code}</Code><Message>{message}</Message>"
                f"<Resource>{self.path.split('?')[0]}</Resource><RequestId>flaky-proxy</RequestId></Error>"
            ).encode()
            self._send(status, xml, "application/xml")
        else:
            status = self._forward()
        with st.lock:
            st.log.append(
                {
                    "method": self.command,
                    "path": self.path,
                    "range": self.headers.get("Range"),
                    "status": status,
                    "injected": err is not None,
                    "cut": self._cut,
                    "start": start,
                    "end": self._last_write,
                }
            )

    def _forward(self) -> int:
        st = self.server.state
        conn = http.client.HTTPConnection(st.host, st.port, timeout=120)
        try:
            conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            chunked = self.headers.get("Transfer-Encoding", "").lower() == "chunked"
            for name, value in self.headers.items():
                # "Expect: 100-continue" was answered by the stdlib already; the body follows.
                if name.lower() not in _HOP and name.lower() != "expect":
                    conn.putheader(name, value)
            if chunked:
                conn.putheader("Transfer-Encoding", "chunked")
            conn.endheaders()
            for chunk in self._body_chunks():
                conn.send(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
            if chunked:
                conn.send(b"0\r\n\r\n")
            resp = conn.getresponse()
            length = resp.getheader("Content-Length")
            body = None if length is not None or self.command == "HEAD" else resp.read()
            self.send_response(resp.status, resp.reason)
            for name, value in resp.getheaders():
                if name.lower() not in _HOP and not (body is not None and name.lower() == "content-length"):
                    self.send_header(name, value)
            if body is not None:
                self.send_header("Content-Length", str(len(body)))
            self._write()
            if body is not None:
                if self.command != "HEAD":
                    self._write(body)
            elif self.command != "HEAD":
                left = -1  # bytes still to send before a cut; -1: no cut
                reads_object = self.command == "GET" and "list-type=" not in self.path
                if reads_object and int(length or 0) >= 2 and st.decide_cut():
                    self._cut, left = True, int(length or 0) // 2
                while chunk := resp.read(_CHUNK if left < 0 else min(_CHUNK, left)):
                    self._write(chunk)
                    if left >= 0:
                        left -= len(chunk)
                        if left == 0:
                            self.close_connection = True  # the client sees a short body
                            break
            return resp.status
        finally:
            conn.close()

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128

    def __init__(self, addr: tuple[str, int], state: _State) -> None:
        super().__init__(addr, _Handler)
        self.state = state


def serve(
    upstream: str, error_rate: float, seed: int, port: int = 0, host: str = "127.0.0.1", cut_rate: float = 0.0
) -> None:
    """Run the proxy in this process until interrupted; prints ``PORT <n>`` first."""
    server = _Server((host, port), _State(upstream, error_rate, seed, cut_rate))
    print(f"PORT {server.server_address[1]}", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


class FlakyProxy(ChildService):
    """Start ``python -m support.flaky_proxy`` as a child process; stop it by PID."""

    def __init__(self, upstream: str, error_rate: float = 0.2, seed: int = 1, cut_rate: float = 0.0) -> None:
        self.upstream, self.error_rate, self.seed, self.cut_rate = upstream, error_rate, seed, cut_rate
        self._proc: subprocess.Popen[str] | None = None
        self.port = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 15.0) -> FlakyProxy:
        cmd = [sys.executable, "-m", "support.flaky_proxy", "--upstream", self.upstream]
        cmd += ["--error-rate", str(self.error_rate), "--seed", str(self.seed), "--port", "0"]
        cmd += ["--cut-rate", str(self.cut_rate)]
        self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=child_env())
        assert self._proc.stdout is not None
        timer = threading.Timer(timeout_s, self._proc.kill)
        timer.start()
        try:
            line = self._proc.stdout.readline()
        finally:
            timer.cancel()
        if not line.startswith("PORT "):
            self.stop()
            raise RuntimeError(f"flaky proxy did not start (got {line!r})")
        self.port = int(line.split()[1])
        return self

    def _get(self, path: str) -> Any:
        with urllib.request.urlopen(f"{self.endpoint}/__proxy__/{path}", timeout=10) as r:
            return json.loads(r.read())

    def stats(self) -> dict[str, int]:
        """Counters: requests, forwarded, injected, injected_503, injected_500, cut."""
        return self._get("stats")

    def request_log(self) -> list[dict[str, Any]]:
        """Every proxied request: method, path, range, status, injected, cut, start, end (epoch s)."""
        return self._get("log")

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            if self._proc.stdout:
                self._proc.stdout.close()
            self._proc = None


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m support.flaky_proxy", description=__doc__.split("\n")[0])
    p.add_argument("--upstream", required=True, help="the S3 server, http://host:port")
    p.add_argument("--error-rate", type=float, default=0.2, help="fraction of requests to fail (0..1)")
    p.add_argument(
        "--seed", type=int, default=1, help="RNG seed: the same seed fails the same request numbers"
    )
    p.add_argument("--port", type=int, default=0, help="listen port on 127.0.0.1 (0: a free one)")
    p.add_argument("--cut-rate", type=float, default=0.0, help="fraction of GET bodies to cut in half (0..1)")
    args = p.parse_args(argv)
    if not 0.0 <= args.error_rate <= 1.0:
        p.error("--error-rate must be within 0..1")
    if not 0.0 <= args.cut_rate <= 1.0:
        p.error("--cut-rate must be within 0..1")
    serve(args.upstream, args.error_rate, args.seed, args.port, cut_rate=args.cut_rate)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())

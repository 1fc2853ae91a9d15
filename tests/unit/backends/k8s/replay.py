"""A tiny HTTP server that replays recorded Kubernetes API exchanges, in order, to the real client.

An exchange file (``exchanges/*.json``) is a list of ``{"request": {"method", "path", "body"?},
"response": {"status", "body"}}``. Each request the client sends must be the next one recorded (method,
path without the query, and the JSON body when one is recorded); the server answers with the recorded
response. A request that does not match is answered 500 and kept in :attr:`Replay.mismatches`; the test
asserts none happened and that every exchange was used. The exchanges were written from the API's
reference shapes (Node, Status), not captured from a live cluster: no API server can run here.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

EXCHANGES = Path(__file__).parent / "exchanges"


class Replay:
    def __init__(self, exchanges: list[dict[str, Any]]) -> None:
        self.exchanges = list(exchanges)
        self.seen: list[dict[str, Any]] = []  # what the client actually sent
        self.mismatches: list[str] = []
        self._lock = threading.Lock()
        replay = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                return None

            def _serve(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n) if n else b""
                body = json.loads(raw) if raw else None
                ctype = self.headers.get("Content-Type")
                status, answer = replay.answer(self.command, self.path, ctype, body)
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PATCH = do_POST = do_DELETE = do_PUT = _serve

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @classmethod
    def load(cls, name: str) -> Replay:
        return cls(json.loads((EXCHANGES / f"{name}.json").read_text()))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def answer(self, method: str, path: str, ctype: str | None, body: Any) -> tuple[int, Any]:
        with self._lock:
            self.seen.append({"method": method, "path": path, "content_type": ctype, "body": body})
            if not self.exchanges:
                self.mismatches.append(f"unexpected {method} {path}: no exchange left")
                return 500, {"kind": "Status", "status": "Failure", "message": "no exchange left"}
            want = self.exchanges[0]["request"]
            same = want["method"] == method and want["path"] == path.split("?", 1)[0]
            if same and "body" in want:
                same = want["body"] == body
            if same and "content_type" in want:
                same = want["content_type"] == ctype
            if not same:
                self.mismatches.append(f"expected {want}, got {method} {path} {ctype} {body}")
                return 500, {"kind": "Status", "status": "Failure", "message": "mismatch"}
            rec = self.exchanges.pop(0)["response"]
            return int(rec["status"]), rec["body"]

    def __enter__(self) -> Replay:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def core(self) -> Any:
        """A real ``kubernetes.client.CoreV1Api`` talking to this server."""
        from kubernetes import client

        cfg = client.Configuration()
        cfg.host = self.url
        cfg.retries = 0
        return client.CoreV1Api(client.ApiClient(cfg))

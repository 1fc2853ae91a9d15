"""``gpufleet serve mock``: an OpenAI-compatible server with known, configurable latencies.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streaming SSE and not),
``GET /v1/models``, ``GET /health``, and ``GET /mock/stats`` (what the mock did: arrivals, injected
failures, peak batch and queue). The latency and queueing model lives in
:mod:`gpufleet.serve.mock.batching`; this module speaks HTTP.

Why raw asyncio and not aiohttp: the mock must never be the bottleneck of a benchmark and must put
each token on the wire when the model says so. A small HTTP/1.1 server on asyncio streams
(keep-alive, Content-Length request bodies, chunked SSE responses, TCP_NODELAY) has no per-request
framework overhead, needs no dependency (so ``gpufleet serve mock`` works on a bare install), and
uses uvloop when it is installed. It accepts what OpenAI clients send, nothing more.

Output length: ``max_tokens`` (or ``max_completion_tokens``) from the request, else
``output_len``; the mock always produces exactly that many tokens (like ``ignore_eos``). A request
whose prompt tokens plus output tokens exceed ``context_len`` gets an OpenAI-style 400.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from typing import Any

from gpufleet.serve.mock.batching import BatchScheduler, FailMode, MockConfig, count_tokens

__all__ = ["MockServer", "prompt_text"]

_MAX_HEAD = 64 * 1024
_MAX_BODY = 64 * 1024 * 1024
_REASONS = {
    200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 500: "Internal Server Error"
}  # fmt: skip


class _BadRequest(Exception):
    """An invalid request: answered with an OpenAI-style 400 (or another status)."""

    def __init__(self, message: str, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


def _error_body(message: str, kind: str, code: str | None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def prompt_text(body: dict[str, Any], chat: bool) -> list[str]:
    """The prompt pieces the token rule is applied to: one per chat message, or the prompt(s)."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _BadRequest("'messages' must be a non-empty list")
        pieces: list[str] = []
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                pieces.append(content)
            elif isinstance(content, list):  # content parts: only text parts carry tokens here
                pieces.extend(
                    str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text"
                )
            elif content is not None:
                raise _BadRequest("message 'content' must be a string or a list of parts")
        return pieces
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    raise _BadRequest("'prompt' must be a string or a list of strings")


class MockServer:
    """The mock server on one event loop: ``await start()``, ``await serve_forever()``, ``await stop()``."""

    def __init__(self, config: MockConfig, host: str = "127.0.0.1", port: int = 0) -> None:
        self.config = config
        self.host = host
        self.port = port
        self.scheduler = BatchScheduler(config)
        self._server: asyncio.Server | None = None
        self._started = time.time()
        self.counts: dict[str, int] = {
            "completed": 0, "failed_500": 0, "failed_midstream": 0, "failed_disconnect": 0,
            "rejected_400": 0, "client_gone": 0,
        }  # fmt: skip

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    async def start(self) -> MockServer:
        self._server = await asyncio.start_server(
            self._connection, self.host, self.port, limit=_MAX_HEAD, backlog=4096, reuse_address=True
        )
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def serve_forever(self) -> None:
        assert self._server is not None, "start() first"
        await self._server.serve_forever()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            self._server = None

    def stats(self) -> dict[str, Any]:
        return {**self.scheduler.stats(), **self.counts, "config": self.config.as_dict()}

    # ------------------------------------------------------------------------------- HTTP layer

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while await self._one_request(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass  # the client went away or sent garbage: drop the connection
        finally:
            writer.close()

    async def _one_request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Serve one request; False when the connection should close."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return False
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3:
            await self._error(writer, 400, "malformed request line", False)
            return False
        method, target, version = parts
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        conn = headers.get("connection", "").lower()
        keep = conn != "close" if version == "HTTP/1.1" else conn == "keep-alive"
        if "chunked" in headers.get("transfer-encoding", "").lower():
            await self._error(writer, 400, "chunked request bodies are not supported", False)
            return False
        try:
            length = int(headers.get("content-length", "0"))
        except ValueError:
            length = -1
        if not 0 <= length <= _MAX_BODY:
            await self._error(writer, 400, "bad Content-Length", False)
            return False
        if length and headers.get("expect", "").lower() == "100-continue":  # curl, for bodies > 1 KiB
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        body = await reader.readexactly(length) if length else b""
        path = target.split("?", 1)[0].rstrip("/")
        return await self._route(method, path, body, writer, keep)

    async def _route(
        self, method: str, path: str, body: bytes, writer: asyncio.StreamWriter, keep: bool
    ) -> bool:
        if path in ("/v1/chat/completions", "/v1/completions"):
            if method != "POST":
                await self._error(writer, 405, "use POST", keep)
                return keep
            return await self._completion(path.endswith("chat/completions"), body, writer, keep)
        if method != "GET":
            await self._error(writer, 405, "use GET", keep)
        elif path == "/v1/models":
            model = {"id": self.config.model, "object": "model", "created": int(self._started),
                     "owned_by": "gpufleet-mock"}  # fmt: skip
            await self._send_json(writer, 200, {"object": "list", "data": [model]}, keep)
        elif path in ("/health", "/v1/health"):
            await self._send_json(writer, 200, {"status": "ok"}, keep)
        elif path == "/mock/stats":
            await self._send_json(writer, 200, self.stats(), keep)
        else:
            await self._error(writer, 404, f"no route {path}", keep)
        return keep

    async def _error(
        self, writer: asyncio.StreamWriter, status: int, message: str, keep: bool, code: str | None = None
    ) -> None:
        kind = "server_error" if status >= 500 else "invalid_request_error"
        await self._send_json(writer, status, _error_body(message, kind, code), keep)

    async def _send_json(self, writer: asyncio.StreamWriter, status: int, obj: Any, keep: bool) -> None:
        data = json.dumps(obj, separators=(",", ":")).encode()
        head = (
            f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: {'keep-alive' if keep else 'close'}\r\n\r\n"
        )
        writer.write(head.encode() + data)
        await writer.drain()

    # ------------------------------------------------------------------------- the completion

    def _parse(self, chat: bool, raw: bytes) -> tuple[dict[str, Any], int, int]:
        """The request body, its prompt tokens and the output tokens to produce, or ``_BadRequest``."""
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise _BadRequest("the body is not valid JSON") from None
        if not isinstance(body, dict):
            raise _BadRequest("the body must be a JSON object")
        prompt_tokens = sum(count_tokens(p, self.config.token_rule) for p in prompt_text(body, chat))
        n = body.get("max_completion_tokens", body.get("max_tokens"))
        if n is None:
            n = self.config.output_len
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise _BadRequest(f"max_tokens must be a positive integer, got {n!r}")
        ctx = self.config.context_len
        if prompt_tokens + n > ctx:
            raise _BadRequest(
                f"This model's maximum context length is {ctx} tokens. However, you requested "
                f"{prompt_tokens + n} tokens ({prompt_tokens} in the messages, {n} in the completion). "
                "Please reduce the length of the messages or completion.",
                code="context_length_exceeded",
            )
        return body, prompt_tokens, n

    async def _completion(self, chat: bool, raw: bytes, writer: asyncio.StreamWriter, keep: bool) -> bool:
        sched = self.scheduler
        index = sched.next_index()
        try:
            body, prompt_tokens, n = self._parse(chat, raw)
        except _BadRequest as e:
            self.counts["rejected_400"] += 1
            await self._error(writer, e.status, str(e), keep, e.code)
            return keep
        failure = sched.failure_for(index)
        if failure == FailMode.HTTP_500:
            self.counts["failed_500"] += 1
            await self._error(writer, 500, "injected failure (gpufleet mock)", keep)
            return keep
        stream = bool(body.get("stream"))
        emitter = _Emitter(self.config, chat, index, body, prompt_tokens, n, writer)
        if stream:
            await emitter.headers()  # an answer starts at once; the tokens come when the model says
        await sched.admit()
        try:
            return await self._generate(emitter, stream, prompt_tokens, n, failure, keep)
        except ConnectionError:
            self.counts["client_gone"] += 1
            return False
        finally:
            sched.release()

    async def _generate(
        self, em: _Emitter, stream: bool, prompt_tokens: int, n: int, failure: str | None, keep: bool
    ) -> bool:
        loop = asyncio.get_running_loop()
        sched = self.scheduler
        cut = n // 2 if failure in (FailMode.MIDSTREAM, FailMode.DISCONNECT) else None
        due = loop.time() + sched.delay(self.config.prefill(prompt_tokens))
        per_chunk = self.config.tokens_per_chunk
        sent = 0
        while sent < n:
            k = min(per_chunk, n - sent)
            for _ in range(k - 1):  # a chunk of k tokens goes out when its last token is due
                due += sched.delay(self.config.itl(sched.running))
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if cut is not None and sent >= cut:
                break
            if stream:
                await em.tokens(sent, k)
            sent += k
            if sent < n:
                due += sched.delay(self.config.itl(sched.running))
        if cut is not None:
            self.counts["failed_" + str(failure)] += 1
            if failure == FailMode.MIDSTREAM and stream:
                await em.stream_error()
                return keep
            if failure == FailMode.MIDSTREAM:
                await self._error(em.writer, 500, "injected failure (gpufleet mock)", keep)
                return keep
            em.writer.transport.abort()  # "disconnect": the connection just drops
            return False
        self.counts["completed"] += 1
        if stream:
            await em.finish()
        else:
            await self._send_json(em.writer, 200, em.whole(), keep)
        return keep


class _Emitter:
    """Formats one completion's SSE chunks (chat or text) and writes them chunk-encoded."""

    def __init__(
        self, cfg: MockConfig, chat: bool, index: int, body: dict[str, Any], prompt_tokens: int, n: int,
        writer: asyncio.StreamWriter,
    ) -> None:  # fmt: skip
        self.cfg, self.chat, self.n, self.writer = cfg, chat, n, writer
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-mock-{index}"
        self.created = int(time.time())
        opts = body.get("stream_options")
        self.include_usage = cfg.stream_usage and isinstance(opts, dict) and bool(opts.get("include_usage"))
        total = prompt_tokens + n
        self.usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": total}
        self._object = "chat.completion.chunk" if chat else "text_completion"

    async def _write(self, payload: bytes) -> None:
        self.writer.write(b"%x\r\n%s\r\n" % (len(payload), payload))
        await self.writer.drain()

    def _event(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
        obj: dict[str, Any] = {"id": self.id, "object": self._object, "created": self.created,
                               "model": self.cfg.model, "choices": choices}  # fmt: skip
        if self.include_usage:
            obj["usage"] = usage
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

    def _choice(self, text: str, finish: str | None = None, role: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, str] = {"content": text} if text or finish is None else {}
            if role:
                delta["role"] = "assistant"
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

    def _empties(self) -> bytes:
        return self._event([self._choice("")]) * self.cfg.empty_chunks

    async def headers(self) -> None:
        head = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                b"Transfer-Encoding: chunked\r\nConnection: keep-alive\r\n\r\n")  # fmt: skip
        self.writer.write(head)
        first = self._event([self._choice("", role=True)]) if self.chat else b""
        if first or self.cfg.empty_chunks:  # empty chunks before any token, like llama.cpp and OpenAI
            await self._write(first + self._empties())
        else:
            await self.writer.drain()

    @staticmethod
    def text(start: int, k: int) -> str:
        return "".join(f" w{(start + j) % 97}" for j in range(k))

    async def tokens(self, start: int, k: int) -> None:
        payload = self._event([self._choice(self.text(start, k))])
        await self._write((self._empties() if start else b"") + payload)

    async def finish(self) -> None:
        out = self._event([self._choice("", finish="length")])
        if self.include_usage:
            out += self._event([], self.usage)
        await self._write(out + b"data: [DONE]\n\n")
        self.writer.write(b"0\r\n\r\n")
        await self.writer.drain()

    async def stream_error(self) -> None:
        err = _error_body("injected failure mid-stream (gpufleet mock)", "server_error", None)
        await self._write(b"data: " + json.dumps(err).encode() + b"\n\n")
        self.writer.write(b"0\r\n\r\n")
        await self.writer.drain()

    def whole(self) -> dict[str, Any]:
        text = self.text(0, self.n)
        choice: dict[str, Any] = (
            {"index": 0, "message": {"role": "assistant", "content": text}}
            if self.chat
            else {"index": 0, "text": text}
        )
        choice.update(logprobs=None, finish_reason="length")
        obj = "chat.completion" if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.cfg.model,
                "choices": [choice], "usage": self.usage}  # fmt: skip

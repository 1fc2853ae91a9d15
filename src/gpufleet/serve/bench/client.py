"""One streamed request over the OpenAI API (aiohttp), and the record it leaves.

Times are ``time.perf_counter()`` seconds (CLOCK_MONOTONIC on Linux: shared by all processes of a
run). ``sent`` is taken when the request's coroutine starts to issue the HTTP request, so TTFT and
e2e include connection set-up and everything the server does, and send lag = sent − intended.

Failures are recorded, never raised: ``connect``, ``timeout``, ``http_<status>``, ``stream_error``,
``malformed_sse``, ``disconnected``, ``no_content``, ``incomplete_stream``, ``client_error``,
``interrupted``.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, get_args

from gpufleet.serve.bench.sse import StreamState
from gpufleet.serve.common.workload import RequestSpec

if TYPE_CHECKING:
    import aiohttp

__all__ = ["ClientConfig", "RequestRecord", "Tokenizer", "endpoint_url", "build_body", "send", "count_tokens"]


class Tokenizer(Protocol):
    def count(self, text: str) -> int: ...


@dataclass
class RequestRecord:
    """What happened to one request. Times are seconds relative to the run's start."""

    index: int
    intended_s: float
    sent_s: float = 0.0
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int | None = None
    prompt_tokens: int | None = None
    token_source: TokenSource | Literal[""] = ""  # "": no tokens counted (the request failed)
    input_tokens_asked: int = 0
    output_tokens_asked: int = 0
    chunks: int = 0  # non-empty content chunks
    finish_reason: str = ""
    error: str = ""  # empty when the request succeeded
    error_detail: str = ""
    http_status: int = 0
    warmup: bool = False
    itl_s: list[float] = field(default_factory=list)  # gaps between content chunks (not in CSV)

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def lag_s(self) -> float:
        return self.sent_s - self.intended_s

    @property
    def tpot_s(self) -> float | None:
        """(e2e − TTFT)/(output tokens − 1); None with fewer than two output tokens."""
        if self.ttft_s is None or self.e2e_s is None or not self.output_tokens or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


TokenSource = Literal["usage", "max_tokens", "tokenizer", "estimate"]
"""Where an output token count came from, most to least exact."""
TOKEN_SOURCES: tuple[TokenSource, ...] = get_args(TokenSource)

Api = Literal["chat", "completions"]
"""Which OpenAI endpoint: ``/v1/chat/completions`` or ``/v1/completions``."""
APIS: tuple[Api, ...] = get_args(Api)


@dataclass(frozen=True)
class ClientConfig:
    url: str  # full endpoint URL (see endpoint_url)
    model: str
    api: Api = "chat"
    timeout_s: float = 600.0
    exact_output: bool = True  # also send min_tokens and ignore_eos (extra fields; ignored if unknown)
    extra: tuple[tuple[str, Any], ...] = ()


def endpoint_url(base: str, api: Api) -> str:
    """``http://h:p`` or ``http://h:p/v1`` → the chat or completions endpoint; full URLs are kept."""
    u = base.rstrip("/")
    if u.endswith(("/chat/completions", "/completions")):
        return u
    if not u.endswith("/v1"):
        u += "/v1"
    return u + ("/chat/completions" if api == "chat" else "/completions")


def build_body(cfg: ClientConfig, spec: RequestSpec) -> bytes:
    body: dict[str, Any] = {
        "model": cfg.model,
        "stream": True,
        "max_tokens": spec.output_tokens,
        "stream_options": {"include_usage": True},
    }
    if cfg.api == "chat":
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    if cfg.exact_output:
        body["min_tokens"] = spec.output_tokens
        body["ignore_eos"] = True
    body.update(dict(cfg.extra))
    return json.dumps(body, separators=(",", ":")).encode()


def count_tokens(rec: RequestRecord, st: StreamState, tokenizer: Tokenizer | None) -> None:
    """Output tokens from usage, else the named tokenizer, else max_tokens on a 'length' finish,
    else an estimate (4 characters per token). Chunks are never counted as tokens."""
    u = st.usage or {}
    ct, pt = u.get("completion_tokens"), u.get("prompt_tokens")
    if isinstance(pt, int):
        rec.prompt_tokens = pt
    if isinstance(ct, int) and ct > 0:
        rec.output_tokens, rec.token_source = ct, "usage"
    elif tokenizer is not None:
        rec.output_tokens, rec.token_source = tokenizer.count("".join(st.parts)), "tokenizer"
    elif st.finish_reason == "length":
        rec.output_tokens, rec.token_source = rec.output_tokens_asked, "max_tokens"
    else:
        chars = sum(len(p) for p in st.parts)
        rec.output_tokens, rec.token_source = max(1, round(chars / 4)), "estimate"


async def send(
    session: aiohttp.ClientSession,
    cfg: ClientConfig,
    body: bytes,
    rec: RequestRecord,
    t0: float,
    tokenizer: Tokenizer | None = None,
) -> RequestRecord:
    """Issue one streamed request; fill ``rec`` (times relative to ``t0``). Never raises on failure."""
    import aiohttp

    st = StreamState()
    perf = time.perf_counter
    sent = perf()
    rec.sent_s = sent - t0
    try:
        async with asyncio.timeout(cfg.timeout_s):
            async with session.post(cfg.url, data=body, headers=_HEADERS) as resp:
                rec.http_status = resp.status
                if resp.status != 200:
                    text = (await resp.content.read(300)).decode("utf-8", "replace")
                    rec.error, rec.error_detail = f"http_{resp.status}", " ".join(text.split())[:200]
                else:
                    buf = b""
                    async for data in resp.content.iter_any():
                        now = perf()
                        buf += data
                        *lines, buf = buf.split(b"\n")
                        for line in lines:
                            st.feed(line, now)
                        if st.error is not None:
                            break
                    if buf:
                        st.feed(buf, perf())
                    st.close()
    except TimeoutError:
        rec.error, rec.error_detail = "timeout", f"no complete response within {cfg.timeout_s:g}s"
    except aiohttp.ClientConnectorError as e:
        rec.error, rec.error_detail = "connect", str(e)[:200]
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as e:
        rec.error, rec.error_detail = "disconnected", str(e)[:200] or type(e).__name__
    except (aiohttp.ClientError, OSError, ValueError) as e:  # ValueError: aiohttp's bad-URL/line-too-long
        rec.error, rec.error_detail = "client_error", f"{type(e).__name__}: {e}"[:200]
    except asyncio.CancelledError:
        rec.error, rec.error_detail = "interrupted", "the run was stopped"
        _finish(rec, st, sent, t0, tokenizer)
        raise
    _finish(rec, st, sent, t0, tokenizer)
    return rec


_HEADERS = {"Content-Type": "application/json", "Accept": "text/event-stream"}


def _finish(rec: RequestRecord, st: StreamState, sent: float, t0: float, tokenizer: Tokenizer | None) -> None:
    end = time.perf_counter()
    rec.e2e_s = end - sent
    times = st.content_times
    rec.chunks = len(times)
    if times:
        rec.ttft_s = times[0] - sent
        rec.itl_s = [b - a for a, b in zip(times, times[1:], strict=False)]
    rec.finish_reason = st.finish_reason or ""
    if not rec.error and st.error is not None:
        rec.error, rec.error_detail = st.error
    if not rec.error and not times:
        rec.error, rec.error_detail = "no_content", "the stream carried no output text"
    if not rec.error and not st.done and st.finish_reason is None:
        rec.error, rec.error_detail = "incomplete_stream", "the stream ended without [DONE] or finish_reason"
    if times:
        count_tokens(rec, st, tokenizer)

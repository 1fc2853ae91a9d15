"""The mock OpenAI server: its model (batching.py) and its HTTP answers (mock.py), in-process."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from gpufleet.core.errors import ConfigError
from gpufleet.serve.mock.batching import BatchScheduler, FailMode, MockConfig, TokenRule, count_tokens
from gpufleet.serve.mock.server import MockServer

# ------------------------------------------------------------------------------------ the model


def test_count_tokens_rules() -> None:
    assert count_tokens("the cat  sat\non the mat") == 6
    assert count_tokens("") == 0
    assert count_tokens("abcdefghi", "chars4") == 3
    with pytest.raises(ConfigError, match="words, chars4"):
        count_tokens("x", "bpe")


def test_config_validates_and_model_formulas() -> None:
    cfg = MockConfig(ttft_s=0.2, itl_s=0.02, alpha=0.5, prefill_per_token_s=0.001, max_batch=4)
    assert cfg.itl(1) == pytest.approx(0.02)
    assert cfg.itl(3) == pytest.approx(0.02 * 2.0)
    assert cfg.prefill(100) == pytest.approx(0.3)
    assert cfg.service_time(100, 11, 1) == pytest.approx(0.3 + 10 * 0.02)
    for bad in ({"max_batch": 0}, {"fail_rate": 1.5}, {"fail_mode": "x"}, {"jitter": -1}, {"model": " "}):
        with pytest.raises(ConfigError):
            MockConfig(**bad)  # type: ignore[arg-type]
    named = MockConfig(token_rule="chars4", fail_mode="mixed")  # type: ignore[arg-type]
    assert named.token_rule is TokenRule.CHARS4 and named.fail_mode is FailMode.MIXED


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        (["--ttft", "abc"], "--ttft: 'abc' is not a duration"),
        (["--itl", "-1ms"], "--itl: '-1ms' is not a duration"),
        (["--prefill-per-token", "5parsecs"], "--prefill-per-token"),
        (["--fail-mode", "x"], "fail mode 'x' unknown; choose one of 500, midstream, disconnect, mixed"),
        (["--token-rule", "bpe"], "token rule 'bpe' unknown; choose one of words, chars4"),
    ],
)
def test_cli_bad_flags_are_one_line_exit_2(
    args: list[str], expect: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpufleet.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "mock", "--port", "0", *args])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and expect in err, err


@pytest.mark.parametrize("rate", [0.0, 0.1, 0.25, 1 / 3, 0.5, 1.0])
def test_failures_exact_count(rate: float) -> None:
    sched = BatchScheduler(MockConfig(fail_rate=rate, fail_mode="mixed", seed=3))
    for n in (1, 7, 40, 100):
        fails = [sched.failure_for(i) for i in range(n)]
        assert sum(f is not None for f in fails) == math.floor(n * rate + 1e-9)
    kinds = {sched.failure_for(i) for i in range(200)} - {None}
    assert kinds <= {"500", "midstream", "disconnect"}
    if rate >= 0.25:
        assert len(kinds) == 3  # mixed draws every kind


def test_scheduler_fifo_and_cancel() -> None:
    async def go() -> list[int]:
        sched = BatchScheduler(MockConfig(max_batch=2))
        order: list[int] = []

        async def req(i: int, hold: float) -> None:
            await sched.admit()
            order.append(i)
            await asyncio.sleep(hold)
            sched.release()

        tasks = [asyncio.create_task(req(i, 0.05)) for i in range(5)]
        await asyncio.sleep(0.01)
        assert sched.running == 2 and sched.waiting == 3
        tasks[3].cancel()  # a waiter that gives up leaves the queue
        await asyncio.gather(*tasks, return_exceptions=True)
        assert sched.running == 0 and sched.waiting == 0 and sched.max_running == 2
        return order

    assert asyncio.run(go()) == [0, 1, 2, 4]


# ---------------------------------------------------------------------------- a tiny client


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes = b""
    events: list[tuple[float, Any]] = field(default_factory=list)  # (seconds since send, data)
    closed_early: bool = False
    sent_at: float = 0.0  # perf_counter() when the request was written

    def json(self) -> Any:
        return json.loads(self.body)


async def request(
    port: int, path: str, body: dict[str, Any] | None = None, raw: bytes | None = None
) -> Reply:
    """One HTTP/1.1 request; SSE events are timestamped as their chunk arrives."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = raw if raw is not None else json.dumps(body).encode() if body is not None else b""
    method = "POST" if body is not None or raw is not None else "GET"
    writer.write(
        f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n"
        f"Connection: close\r\n\r\n".encode()
        + data
    )
    t0 = time.perf_counter()
    try:
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        status = int(head.split(" ", 2)[1])
        pairs = (ln.partition(":") for ln in head.split("\r\n")[1:] if ln)
        headers = {k.strip().lower(): v.strip() for k, _, v in pairs}
        reply = Reply(status, headers, sent_at=t0)
        if headers.get("transfer-encoding") != "chunked":
            reply.body = await reader.readexactly(int(headers["content-length"]))
            return reply
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            if size == 0:
                return reply
            chunk = (await reader.readexactly(size + 2))[:-2]
            now = time.perf_counter() - t0
            for line in chunk.decode().split("\n\n"):
                if line.startswith("data: "):
                    payload = line[6:]
                    reply.events.append((now, payload if payload == "[DONE]" else json.loads(payload)))
    except (asyncio.IncompleteReadError, ConnectionError):
        reply.closed_early = True
        return reply
    finally:
        writer.close()


def with_server(cfg: MockConfig, fn: Callable[[int, MockServer], Awaitable[None]]) -> None:
    async def go() -> None:
        server = await MockServer(cfg).start()
        serving = asyncio.create_task(server.serve_forever())
        try:
            await fn(server.port, server)
        finally:
            serving.cancel()
            await server.stop()

    asyncio.run(go())


def chat(n: int | None = 4, stream: bool = True, usage: bool = True, prompt: str = "one two three") -> dict:
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": prompt}], "stream": stream}
    if n is not None:
        body["max_tokens"] = n
    if usage:
        body["stream_options"] = {"include_usage": True}
    return body


def contents(r: Reply) -> list[str]:
    return [
        e["choices"][0]["delta"].get("content", "")
        for _, e in r.events
        if isinstance(e, dict) and e.get("choices")
    ]


def token_times(r: Reply) -> list[float]:
    """Arrival times of the chunks that carry content (never the empty ones)."""
    return [
        t
        for t, e in r.events
        if isinstance(e, dict) and e.get("choices") and e["choices"][0]["delta"].get("content")
    ]


# --------------------------------------------------------------------------------- answers


def test_stream_chat_usage_and_done() -> None:
    async def fn(port: int, _: MockServer) -> None:
        r = await request(port, "/v1/chat/completions", chat(5, prompt="a b c d e f g"))
        assert r.status == 200 and r.headers["content-type"] == "text/event-stream"
        assert [c for c in contents(r) if c] == [" w0", " w1", " w2", " w3", " w4"]
        assert r.events[-1][1] == "[DONE]"
        assert r.events[-2][1]["usage"] == {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}
        assert r.events[-3][1]["choices"][0]["finish_reason"] == "length"
        # Without include_usage there is no usage field at all.
        r2 = await request(port, "/v1/chat/completions", chat(2, usage=False))
        assert all("usage" not in e for _, e in r2.events if isinstance(e, dict))

    with_server(MockConfig(ttft_s=0.01, itl_s=0.001), fn)


def test_completions_non_stream_and_default_length() -> None:
    async def fn(port: int, _: MockServer) -> None:
        r = await request(port, "/v1/completions", {"model": "m", "prompt": "x y"})
        assert r.status == 200
        out = r.json()
        assert out["object"] == "text_completion" and out["choices"][0]["text"].count(" w") == 6
        assert out["usage"] == {"prompt_tokens": 2, "completion_tokens": 6, "total_tokens": 8}
        r = await request(port, "/v1/completions", {"prompt": ["a b", "c"], "max_tokens": 2, "stream": True})
        texts = [e["choices"][0]["text"] for _, e in r.events if isinstance(e, dict) and e["choices"]]
        assert [t for t in texts if t] == [" w0", " w1"]

    with_server(MockConfig(ttft_s=0.0, itl_s=0.0, output_len=6), fn)


def test_models_health_404_405_and_bad_bodies() -> None:
    async def fn(port: int, server: MockServer) -> None:
        models = (await request(port, "/v1/models")).json()
        assert models["data"][0]["id"] == "llama-x"
        assert (await request(port, "/health")).status == 200
        assert (await request(port, "/v2/nothing")).status == 404
        assert (await request(port, "/v1/chat/completions")).status == 405
        bad = [b"{not json", b"[1]", json.dumps({"messages": []}).encode(),
               json.dumps(chat(0)).encode(), json.dumps({"prompt": 3}).encode()]  # fmt: skip
        for raw in bad:
            path = "/v1/completions" if b"prompt" in raw else "/v1/chat/completions"
            r = await request(port, path, raw=raw)
            assert r.status == 400, raw
            assert r.json()["error"]["type"] == "invalid_request_error"
        assert server.counts["rejected_400"] == len(bad)

    with_server(MockConfig(model="llama-x", ttft_s=0.0, itl_s=0.0), fn)


def test_context_limit_is_openai_400() -> None:
    async def fn(port: int, _: MockServer) -> None:
        assert (await request(port, "/v1/chat/completions", chat(10, prompt="a " * 90))).status == 200
        r = await request(port, "/v1/chat/completions", chat(11, prompt="a " * 90))
        assert r.status == 400
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and "maximum context length is 100" in err["message"]

    with_server(MockConfig(context_len=100, ttft_s=0.0, itl_s=0.0), fn)


def test_empty_chunks_and_tokens_per_chunk() -> None:
    async def fn(port: int, _: MockServer) -> None:
        r = await request(port, "/v1/chat/completions", chat(7))
        cs = contents(r)
        assert [c for c in cs if c] == [" w0 w1 w2", " w3 w4 w5", " w6"]
        assert cs.count("") >= 2 * 3  # role chunk + 2 empties before each token chunk + the finish chunk
        assert r.events[-2][1]["usage"]["completion_tokens"] == 7

    with_server(MockConfig(ttft_s=0.0, itl_s=0.001, tokens_per_chunk=3, empty_chunks=2), fn)


@pytest.mark.parametrize("mode", ["500", "midstream", "disconnect"])
def test_injected_failures(mode: str) -> None:
    async def fn(port: int, server: MockServer) -> None:
        replies = [await request(port, "/v1/chat/completions", chat(6)) for _ in range(4)]
        ok = [r for r in replies if r.status == 200 and r.events and r.events[-1][1] == "[DONE]"]
        assert len(ok) == 2
        bad = [r for r in replies if r not in ok]
        if mode == "500":
            assert all(r.status == 500 and r.json()["error"]["type"] == "server_error" for r in bad)
        elif mode == "midstream":
            for r in bad:
                assert [c for c in contents(r) if c] == [" w0", " w1", " w2"]
                assert "error" in r.events[-1][1] and not r.closed_early
        else:
            assert all(r.closed_early for r in bad)
        assert server.counts[f"failed_{mode}"] == 2 and server.counts["completed"] == 2
        assert server.scheduler.running == 0

    with_server(MockConfig(ttft_s=0.0, itl_s=0.001, fail_rate=0.5, fail_mode=mode), fn)


def test_keep_alive_serves_several_requests_on_one_connection() -> None:
    async def fn(port: int, _: MockServer) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(3):
            writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            head = await reader.readuntil(b"\r\n\r\n")
            assert b"200 OK" in head
            n = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(n)
        writer.close()

    with_server(MockConfig(), fn)


def test_timing_ttft_and_itl_in_process() -> None:
    async def fn(port: int, _: MockServer) -> None:
        r = await request(port, "/v1/chat/completions", chat(6, usage=False))
        times = token_times(r)
        # Token k is never sent before ttft + k * itl (the schedule is absolute, so one late timer
        # does not shift the rest). The upper bound is loose: a loaded 2-core CI host delays timers.
        # The tight checks are in tests/integration/test_serve_mock_bench.py and
        # benchmarks/bench_ttft_accuracy.py.
        assert len(times) == 6
        for k, t in enumerate(times):
            assert 0.1 + k * 0.02 - 0.001 <= t <= 0.1 + k * 0.02 + 0.15, (k, times)

    with_server(MockConfig(ttft_s=0.1, itl_s=0.02), fn)


def test_queueing_beyond_max_batch_and_client_gone_frees_slot() -> None:
    cfg = MockConfig(ttft_s=0.05, itl_s=0.03, max_batch=2, alpha=1.0)

    async def fn(port: int, server: MockServer) -> None:
        start = time.perf_counter()
        replies = await asyncio.gather(*(request(port, "/v1/chat/completions", chat(5)) for _ in range(4)))
        # Two run at once and two wait for a slot: a running request holds it for one service time.
        service = cfg.service_time(3, 5, 2)  # 0.05 + 4 * 0.06 = 0.29 s
        assert server.scheduler.max_running == 2 and server.scheduler.max_waiting == 2
        # The mock is never early and admitted nothing before `start`, so the two queued requests'
        # first tokens come at least service + ttft after it (their own TTFT is shorter when this
        # loop wrote them late). A request not queued has a TTFT of ttft plus this loop's own
        # delays; it is told apart from a queued one at half a service time.
        ttfts = sorted(token_times(r)[0] for r in replies)
        firsts = sorted(r.sent_at + token_times(r)[0] - start for r in replies)
        assert cfg.ttft_s - 0.001 <= ttfts[0] and ttfts[1] < cfg.ttft_s + service / 2, ttfts
        assert firsts[2] >= service + cfg.ttft_s - 0.001, firsts
        # A streaming client that goes away releases its slot at the next token.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        data = json.dumps(chat(1000)).encode()
        head = b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(data)
        writer.write(head + data)
        await reader.readuntil(b"w1")
        writer.close()
        for _ in range(100):
            await asyncio.sleep(0.01)
            if server.scheduler.running == 0:
                break
        assert server.scheduler.running == 0 and server.counts["client_gone"] == 1

    with_server(cfg, fn)


def test_no_stream_usage_like_llama_cpp() -> None:
    async def fn(port: int, _: MockServer) -> None:
        r = await request(port, "/v1/chat/completions", chat(3))
        assert all(isinstance(e, str) or "usage" not in e for _, e in r.events)
        assert [c for c in contents(r) if c] == [" w0", " w1", " w2"]
        whole = (await request(port, "/v1/chat/completions", chat(3, stream=False))).json()
        assert whole["usage"]["completion_tokens"] == 3  # non-streaming answers keep their usage

    with_server(MockConfig(ttft_s=0.0, itl_s=0.0, stream_usage=False), fn)


def test_expect_100_continue() -> None:
    async def fn(port: int, _: MockServer) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        data = json.dumps(chat(2, stream=False)).encode()
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nExpect: 100-continue\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(data))  # fmt: skip
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 100 Continue")
        writer.write(data)
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200 OK")
        writer.close()

    with_server(MockConfig(ttft_s=0.0, itl_s=0.0), fn)

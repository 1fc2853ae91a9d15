"""``gpufleet serve mock``: run the mock OpenAI-compatible server (see docs/serve-mock.md).

``register(app)`` adds the command to the ``serve`` group. Without the console script:
``python -m gpufleet.cli.main serve mock ...`` (tests and scripts start the mock this way).
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

__all__ = ["register", "mock_command"]


def register(app: typer.Typer) -> None:
    app.command("mock")(mock_command)


def mock_command(
    host: Annotated[str, typer.Option(help="Address to bind (loopback by default).")] = "127.0.0.1",
    port: Annotated[
        int, typer.Option(min=0, max=65535, help="Port to listen on; 0 picks a free one.")
    ] = 8000,
    model: Annotated[str, typer.Option(help="Model name in /v1/models and in answers.")] = "mock",
    ttft: Annotated[str, typer.Option(help="Time to first token of an admitted request.")] = "200ms",
    itl: Annotated[str, typer.Option(help="Gap between tokens of one request running alone.")] = "20ms",
    jitter: Annotated[float, typer.Option(help="Relative std-dev of every delay (0: exact).")] = 0.0,
    max_batch: Annotated[int, typer.Option(help="Requests running at once; more wait in a FIFO.")] = 64,
    alpha: Annotated[
        float, typer.Option(help="ITL growth with batch size: itl(b) = itl*(1 + alpha*(b-1)).")
    ] = 0.0,
    prefill_per_token: Annotated[
        str, typer.Option(help="Extra TTFT per prompt token (prefill cost).")
    ] = "0ms",
    output_len: Annotated[int, typer.Option(help="Output tokens when a request gives no max_tokens.")] = 128,
    context: Annotated[
        int, typer.Option(help="Context limit; prompt + max_tokens above it gets a 400.")
    ] = 8192,
    token_rule: Annotated[
        str, typer.Option(help="Prompt token count: words (whitespace words) or chars4 (ceil(chars/4)).")
    ] = "words",
    tokens_per_chunk: Annotated[int, typer.Option(help="Tokens in each streamed chunk.")] = 1,
    empty_chunks: Annotated[
        int, typer.Option(help="Empty-content chunks before every token chunk (llama.cpp sends many).")
    ] = 0,
    stream_usage: Annotated[
        bool, typer.Option(help="Honour stream_options.include_usage (off: like llama.cpp).")
    ] = True,
    fail_rate: Annotated[float, typer.Option(help="Fraction of requests that fail, spread evenly.")] = 0.0,
    fail_mode: Annotated[
        str, typer.Option(help="How they fail: 500, midstream (error event), disconnect, mixed.")
    ] = "500",
    seed: Annotated[int, typer.Option(help="Seed of the jitter and of the mixed failure kinds.")] = 0,
    uvloop: Annotated[bool, typer.Option(help="Use uvloop when it is installed.")] = True,
) -> None:
    """Serve a mock OpenAI-compatible LLM with known TTFT, ITL and a continuous-batching queue."""
    import asyncio

    from gpufleet.core.errors import UsageError
    from gpufleet.core.units import parse_duration
    from gpufleet.serve.mock.batching import MockConfig
    from gpufleet.serve.mock.server import MockServer

    config = MockConfig(
        model=model,
        ttft_s=parse_duration(ttft, "--ttft"),
        itl_s=parse_duration(itl, "--itl"),
        jitter=jitter,
        max_batch=max_batch,
        alpha=alpha,
        prefill_per_token_s=parse_duration(prefill_per_token, "--prefill-per-token"),
        output_len=output_len,
        context_len=context,
        token_rule=token_rule,
        tokens_per_chunk=tokens_per_chunk,
        empty_chunks=empty_chunks,
        stream_usage=stream_usage,
        fail_rate=fail_rate,
        fail_mode=fail_mode,
        seed=seed,
    )
    if not 0 <= port <= 65535:
        raise UsageError(f"--port {port} is not a TCP port")
    if host not in ("127.0.0.1", "localhost", "::1"):
        print(f"gpufleet: warning: the mock listens on {host}, not only on loopback", file=sys.stderr)

    async def serve() -> None:
        server = MockServer(config, host, port)
        try:
            await server.start()
        except OSError as e:
            raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
        print(
            f"gpufleet serve mock: ready at {server.url} (model {config.model},"
            f" ttft {config.ttft_s * 1e3:g} ms, itl {config.itl_s * 1e3:g} ms, max batch {config.max_batch})",
            flush=True,
        )
        try:
            await server.serve_forever()
        finally:
            await server.stop()

    runner = asyncio.run
    if uvloop:
        try:
            import uvloop as _uvloop

            runner = _uvloop.run
        except ImportError:
            pass
    try:
        runner(serve())
    except KeyboardInterrupt:
        print("gpufleet serve mock: stopped", file=sys.stderr)

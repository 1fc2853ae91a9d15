"""The latency and queueing model behind ``gpufleet serve mock``: continuous batching, simplified.

The model (all of it; ``docs/serve-mock.md`` says the same):

* **Admission.** At most ``max_batch`` requests run at once. Later ones wait in one FIFO queue and
  are admitted the moment a running request finishes (or fails, or its client goes away).
* **Prefill.** An admitted request produces its first token after
  ``prefill(L) = ttft + prefill_per_token * L`` seconds, where ``L`` is its prompt length in tokens.
  So the TTFT a client sees is ``queue wait + prefill(L)``: queueing is part of TTFT.
* **Decode.** Every further token comes ``itl(b) = itl0 * (1 + alpha * (b - 1))`` seconds after the
  previous one, where ``b`` is the number of running requests (prefilling or decoding, this one
  included) at the moment the gap starts. ``alpha = 0`` means batching is free; ``alpha = 1``
  means the engine is purely serial in tokens (b requests each see b times the single-request ITL).
* **Jitter.** Each of those delays ``d`` becomes ``d * max(0, 1 + jitter * z)``, ``z ~ N(0, 1)``
  from one generator seeded with ``seed``. ``jitter = 0`` makes every delay exact.
* **Failures.** Request number ``i`` (0-based, in arrival order) fails iff
  ``floor((i + 1) * fail_rate) > floor(i * fail_rate)``: exactly ``floor(N * fail_rate)`` of the
  first ``N`` requests fail, spread evenly. ``seed`` picks the kind when ``fail_mode`` is ``mixed``.

Steady state with ``n`` output tokens per request and the batch full (``b = max_batch``): a request
holds its slot for ``S = prefill(L) + (n - 1) * itl(max_batch)`` seconds, so the engine completes
``max_batch / S`` requests per second; offered more, the queue (and TTFT) grows without bound.

Prompt tokens are counted by a documented rule, never a tokenizer: ``words`` (the default) counts
whitespace-separated words; ``chars4`` counts ``ceil(characters / 4)``. See :func:`count_tokens`.
"""

from __future__ import annotations

import asyncio
import enum
import math
import random
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from gpufleet.core.errors import ConfigError

__all__ = ["FailMode", "TokenRule", "BatchScheduler", "MockConfig", "count_tokens"]


class TokenRule(enum.StrEnum):
    """How the mock counts prompt tokens (never a tokenizer)."""

    WORDS = "words"  # whitespace-separated words
    CHARS4 = "chars4"  # ceil(characters / 4)


class FailMode(enum.StrEnum):
    """How an injected failure looks to the client."""

    HTTP_500 = "500"
    MIDSTREAM = "midstream"  # an SSE error event after some tokens
    DISCONNECT = "disconnect"  # the connection drops mid-stream
    MIXED = "mixed"  # one of the three above per request, picked by the seed


_FAILURES = (FailMode.HTTP_500, FailMode.MIDSTREAM, FailMode.DISCONNECT)


def _choice(enum_type: type[enum.StrEnum], value: object, what: str) -> enum.StrEnum:
    try:
        return enum_type(value)
    except ValueError:
        raise ConfigError(f"{what} {value!r} unknown; choose one of {', '.join(enum_type)}") from None


def count_tokens(text: str, rule: TokenRule | str = TokenRule.WORDS) -> int:
    """Prompt tokens by the mock's documented rule: ``words`` = ``len(text.split())``,
    ``chars4`` = ``ceil(len(text) / 4)``."""
    if _choice(TokenRule, rule, "token rule") == TokenRule.WORDS:
        return len(text.split())
    return (len(text) + 3) // 4


@dataclass(frozen=True)
class MockConfig:
    """Everything that shapes the mock's answers. Validates itself (``ConfigError``)."""

    model: str = "mock"
    ttft_s: float = 0.2
    itl_s: float = 0.02
    jitter: float = 0.0
    max_batch: int = 64
    alpha: float = 0.0
    prefill_per_token_s: float = 0.0
    output_len: int = 128
    context_len: int = 8192
    token_rule: TokenRule = TokenRule.WORDS
    tokens_per_chunk: int = 1
    empty_chunks: int = 0
    stream_usage: bool = True  # False: ignore stream_options.include_usage, like llama.cpp
    fail_rate: float = 0.0
    fail_mode: FailMode = FailMode.HTTP_500
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_rule", _choice(TokenRule, self.token_rule, "token rule"))
        object.__setattr__(self, "fail_mode", _choice(FailMode, self.fail_mode, "fail mode"))
        checks: list[tuple[bool, str]] = [
            (bool(self.model.strip()), "model name must not be empty"),
            (self.ttft_s >= 0 and self.itl_s >= 0, "ttft and itl must be >= 0"),
            (0 <= self.jitter <= 10, f"jitter {self.jitter} must be in [0, 10]"),
            (self.max_batch >= 1, f"max batch {self.max_batch} must be >= 1"),
            (self.alpha >= 0, f"alpha {self.alpha} must be >= 0"),
            (self.prefill_per_token_s >= 0, "prefill per token must be >= 0"),
            (self.output_len >= 1, f"output length {self.output_len} must be >= 1"),
            (self.context_len >= 2, f"context length {self.context_len} must be >= 2"),
            (self.tokens_per_chunk >= 1, "tokens per chunk must be >= 1"),
            (0 <= self.empty_chunks <= 100, "empty chunks must be in [0, 100]"),
            (0.0 <= self.fail_rate <= 1.0, f"fail rate {self.fail_rate} must be in [0, 1]"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)

    def itl(self, batch: int) -> float:
        """Mean gap between two tokens of one request while ``batch`` requests run."""
        return self.itl_s * (1.0 + self.alpha * (max(batch, 1) - 1))

    def prefill(self, prompt_tokens: int) -> float:
        """Mean time from admission to the first token."""
        return self.ttft_s + self.prefill_per_token_s * prompt_tokens

    def service_time(self, prompt_tokens: int, output_tokens: int, batch: int) -> float:
        """How long one request holds its slot when ``batch`` requests run throughout."""
        return self.prefill(prompt_tokens) + max(output_tokens - 1, 0) * self.itl(batch)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class BatchScheduler:
    """FIFO admission into at most ``max_batch`` slots, plus the seeded draws of the model.

    Single event loop only (no locks): ``admit`` / ``release`` are called from coroutines.
    """

    def __init__(self, config: MockConfig) -> None:
        self.config = config
        self.running = 0
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._rng = random.Random(config.seed)
        self._arrivals = 0
        self.max_running = 0
        self.max_waiting = 0

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def next_index(self) -> int:
        """Arrival number of a new request (0-based)."""
        i = self._arrivals
        self._arrivals += 1
        return i

    def failure_for(self, index: int) -> FailMode | None:
        """The failure injected into request ``index`` (``"500"``, ``"midstream"``,
        ``"disconnect"``), or None. Exactly ``floor(N * fail_rate)`` of the first N fail."""
        rate = self.config.fail_rate
        if rate <= 0 or math.floor((index + 1) * rate) == math.floor(index * rate):
            return None
        if self.config.fail_mode != FailMode.MIXED:
            return self.config.fail_mode
        return random.Random(f"{self.config.seed}:{index}").choice(_FAILURES)

    def delay(self, mean: float) -> float:
        """``mean`` with the configured multiplicative Gaussian jitter (never negative)."""
        if self.config.jitter <= 0 or mean <= 0:
            return mean
        return mean * max(0.0, 1.0 + self.config.jitter * self._rng.gauss(0.0, 1.0))

    async def admit(self) -> None:
        """Wait for a free slot (FIFO). On cancellation the place in the queue is given up."""
        if self.running < self.config.max_batch and not self._waiting:
            self._take()
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(fut)
        self.max_waiting = max(self.max_waiting, len(self._waiting))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # the slot was handed over just as we were cancelled
            else:
                self._waiting.remove(fut)
            raise

    def _take(self) -> None:
        self.running += 1
        self.max_running = max(self.max_running, self.running)

    def release(self) -> None:
        """Free a slot and hand it to the oldest waiter, if any."""
        self.running -= 1
        while self._waiting and self.running < self.config.max_batch:
            fut = self._waiting.popleft()
            if not fut.done():
                self._take()
                fut.set_result(None)

    def stats(self) -> dict[str, int]:
        return {
            "arrivals": self._arrivals,
            "running": self.running,
            "waiting": self.waiting,
            "max_running": self.max_running,
            "max_waiting": self.max_waiting,
        }

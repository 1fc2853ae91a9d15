"""falling_behind: a level whose requests complete slower than they are sent fails, however short."""

from __future__ import annotations

from gpufleet.serve.bench.client import RequestRecord
from gpufleet.serve.bench.findmax import falling_behind


def records(send_gap: float, service: float, n: int = 8, e2e: float = 0.3) -> list[RequestRecord]:
    """n requests sent every ``send_gap`` s to a one-at-a-time server taking ``service`` s each."""
    out, free = [], 0.0
    for i in range(n):
        sent = i * send_gap
        start = max(sent, free)
        free = start + service
        out.append(
            RequestRecord(
                index=i, intended_s=sent, sent_s=sent, ttft_s=start - sent + 0.01, e2e_s=free - sent
            )
        )
    return out


def test_a_saturated_server_is_caught_even_when_the_burst_fits_the_slo():
    # 24 req/s offered to a server that completes 3.3 req/s (the llama.cpp case): 8 requests finish
    # within ~2.4 s, which a 2 s-ish TTFT SLO might still pass; the completion rate gives it away.
    assert falling_behind(records(send_gap=1 / 24, service=0.3))


def test_a_server_that_keeps_up_is_not_flagged():
    assert not falling_behind(records(send_gap=0.5, service=0.3))
    assert not falling_behind(records(send_gap=0.5, service=0.3, n=3))  # too few to judge

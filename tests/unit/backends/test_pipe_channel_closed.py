"""PipeChannel.closed: the supervisor stops waiting for a dead worker's last words once its pipe is at EOF."""

from __future__ import annotations

import os

from gpufleet.backends.base import EventChannel
from gpufleet.backends.process import PipeChannel


def test_closed_only_after_the_writer_closed_and_its_last_line_was_read() -> None:
    r0, w0 = os.pipe()
    r1, w1 = os.pipe()
    channel = PipeChannel({r0: 0, r1: 1})
    try:
        os.write(w1, b'{"ev": "inject", "t": 1.0}\n')
        os.close(w1)  # rank 1 wrote its last words and died; rank 0 still runs
        assert not channel.closed(1)  # nothing read yet: the EOF is not known
        events = []
        while not channel.closed(1):
            events += channel.read(0.5)
        assert [(e["ev"], e["rank"]) for e in events] == [("inject", 1)]
        assert not channel.closed(0)
        assert not channel.closed(7)  # a rank this channel does not carry: unknown, not closed
    finally:
        os.close(w0)
        channel.close()
    assert channel.closed(0)  # a closed channel: nothing more can arrive


def test_other_channels_do_not_claim_eof() -> None:
    class Quiet(EventChannel):
        def read(self, timeout: float) -> list[dict]:
            return []

    assert not Quiet().closed(0)

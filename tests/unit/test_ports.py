"""Free ports for child processes: below the ephemeral range, so outgoing connections cannot take them."""

from __future__ import annotations

import socket

from gpufleet.core import ports


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    got = ports.free_ports(5, seed=1)
    assert len(set(got)) == 5
    low = ports._ephemeral_low()
    assert all(ports._FLOOR <= p < low for p in got)
    for p in got:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # still free


def test_a_taken_port_is_skipped_and_a_tiny_range_falls_back_to_the_kernel(monkeypatch) -> None:
    (first,) = ports.free_ports(1, seed=3)  # the seed's first candidate
    with socket.socket() as held:
        held.bind(("127.0.0.1", first))
        (again,) = ports.free_ports(1, seed=3)  # same candidates, the first one now taken
        assert again != first and ports._FLOOR <= again < ports._ephemeral_low()
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: ports._FLOOR + 10)  # no room below it
    (p,) = ports.free_ports(1)
    assert p >= ports._FLOOR + 10  # the kernel's pick, from its ephemeral range

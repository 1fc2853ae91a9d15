"""--min-nproc bookkeeping of the local backend: which failures count against a slot, when it is dropped,
and what the next attempt looks like (fewer ranks, CUDA_VISIBLE_DEVICES naming the live slots)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from gpufleet.backends import Blame, LaunchSpec
from gpufleet.backends.local import LocalBackend, visible_devices
from gpufleet.core import events as E
from gpufleet.core.errors import ConfigError

CRASH, HANG, SPIKE = E.FailureCause.CRASH, E.FailureCause.HANG, E.FailureCause.SPIKE


class Sink:
    def __init__(self) -> None:
        self.events: list[E.Event] = []

    def emit(self, event: Any, **fields: Any) -> None:
        self.events.append(event)


def backend(nproc: int = 3, **kw: Any) -> tuple[LocalBackend, Sink, Any]:
    b = LocalBackend(standby=False, **kw)
    spec = LaunchSpec(command=["true"], nproc_per_node=nproc)
    b.active_slots(spec)  # the first attempt's slots, as start() takes them
    return b, Sink(), lambda: SimpleNamespace(spec=LaunchSpec(["true"], len(b.slots or []), attempt=0))


def fail(b: LocalBackend, sink: Sink, attempt: Any, rank: int, cause: E.FailureCause = CRASH) -> None:
    assert b.after_failure(attempt(), sink, Blame(rank, cause)).restart


def test_a_slot_is_dropped_after_k_failures_in_a_row_and_ranks_renumber() -> None:
    b, sink, att = backend(3, min_nproc=1, slot_failures=2)
    fail(b, sink, att, 1)
    fail(b, sink, att, 1, HANG)  # a hang blamed on the same slot counts too
    assert b.slots == [0, 2] and b.dropped == [1]
    (ev,) = sink.events
    assert isinstance(ev, E.SlotDropped) and (ev.slot, ev.failures, ev.nproc) == (1, 2, 2)
    # rank 1 of the next attempt is slot 2
    fail(b, sink, att, 1)
    fail(b, sink, att, 1)
    assert b.slots == [0] and [e.slot for e in sink.events] == [1, 2]
    # at the floor: never below min_nproc, restarts go on
    fail(b, sink, att, 0)
    fail(b, sink, att, 0)
    assert b.slots == [0] and len(sink.events) == 2


def test_another_slots_failure_resets_the_count_and_a_spike_does_not_count() -> None:
    b, sink, att = backend(2, min_nproc=1, slot_failures=2)
    fail(b, sink, att, 1)
    fail(b, sink, att, 0)  # another slot: the run of failures is broken
    fail(b, sink, att, 1)
    assert b.slots == [0, 1]
    fail(b, sink, att, 0, SPIKE)  # the data's, not the slot's: neither counts nor resets
    fail(b, sink, att, 1)
    assert b.slots == [0] and sink.events


def test_without_min_nproc_nothing_is_dropped() -> None:
    b, sink, att = backend(2)
    for _ in range(5):
        fail(b, sink, att, 1)
    assert b.slots == [0, 1] and not sink.events


def test_live_slots_keep_their_gpus() -> None:
    b, sink, att = backend(3, min_nproc=1, slot_failures=1)
    fail(b, sink, att, 1)
    assert visible_devices(b.slots or [], {}) == {"CUDA_VISIBLE_DEVICES": "0,2"}
    inherited = {"CUDA_VISIBLE_DEVICES": "4,5,6"}
    assert visible_devices(b.slots or [], inherited) == {"CUDA_VISIBLE_DEVICES": "4,6"}


def test_bad_options_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="--min-nproc 3 is more than --nproc-per-node 2"):
        backend(2, min_nproc=3)
    with pytest.raises(ConfigError, match="--slot-failures"):
        LocalBackend(slot_failures=0)

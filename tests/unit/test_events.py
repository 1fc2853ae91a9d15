"""Typed ledger events: the registry, strict writing, lenient reading, the on-disk form."""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import types
import typing
from collections.abc import Mapping
from typing import Any

import pytest

from gpufleet.core import events as E
from gpufleet.core.ledger import Ledger, NullSink, PipeSink, read_events, read_typed
from gpufleet.reliability import metrics
from gpufleet.reliability.synth import LedgerBuilder
from gpufleet.reliability.walk import walk


def _sample(tp: Any) -> Any:
    """A valid, non-default value of the field type ``tp``."""
    if typing.get_origin(tp) in (types.UnionType, typing.Union):
        return _sample(next(a for a in typing.get_args(tp) if a is not type(None)))
    if typing.get_origin(tp) is tuple:
        return (_sample(typing.get_args(tp)[0]),) * 2
    if tp is Mapping or typing.get_origin(tp) is Mapping:
        return {"k": [1, "x"]}
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return list(tp)[-1]
    return {bool: True, int: 7, float: 2.5, str: "x"}[tp]


def _full(cls: type[E.Event]) -> E.Event:
    hints = typing.get_type_hints(cls)
    return cls(**{f.name: _sample(hints[f.name]) for f in dataclasses.fields(cls)})


@pytest.mark.parametrize("kind", sorted(E.EVENT_TYPES))
def test_every_kind_round_trips_through_json(kind: str) -> None:
    cls = E.EVENT_TYPES[kind]
    assert cls.kind == kind
    ev = _full(cls)
    rec = json.loads(json.dumps(ev.to_record()))
    assert rec["ev"] == kind and rec["v"] == E.LEDGER_VERSION
    assert E.parse_event(rec, strict=True) == ev
    assert E.parse_event(rec) == ev
    with pytest.raises(dataclasses.FrozenInstanceError):
        ev.t = 0.0  # type: ignore[misc]
    assert not hasattr(ev, "__dict__")  # slots
    with pytest.raises(TypeError):
        cls(1.0)  # type: ignore[call-arg]  # keyword-only


def test_enums_are_the_plain_strings_on_disk(tmp_path) -> None:
    with Ledger(tmp_path, session="s") as led:
        led.emit(E.Rollback(from_step=9, to_step=5, mode=E.RollbackMode.SKIP, skip_from=5, skip_to=10))
        led.emit(E.Restore(step=0, load_s=0.1, fresh=True))
    rb, rs = read_events(tmp_path)
    assert rb["mode"] == "skip" and rb["session"] == "s" and rb["v"] == 1
    assert "abandoned" not in rb and "path" not in rs and "source" not in rs  # unset optionals omitted
    assert rb["skip_to"] == 10 and rs["fresh"] is True
    typed = read_typed(tmp_path)
    assert isinstance(typed[0], E.Rollback) and typed[0].mode is E.RollbackMode.SKIP
    assert typed[1].source is None  # type: ignore[attr-defined]


def test_keyword_emit_is_validated_through_the_registry(tmp_path) -> None:
    with Ledger(tmp_path) as led:
        led.emit("step", step=3, dt=0.5)
        with pytest.raises(E.EventSchemaError, match="no field.*stepp"):
            led.emit("step", stepp=3, dt=0.5)
        with pytest.raises(E.EventSchemaError, match="needs field.*dt"):
            led.emit("step", step=3)
        with pytest.raises(E.EventSchemaError, match="unknown event kind 'stpe'.*valid kinds"):
            led.emit("stpe", step=3)
        with pytest.raises(E.EventSchemaError, match="failure.cause: 'oom' is not one of crash"):
            led.emit("failure", cause="oom")
        with pytest.raises(E.EventSchemaError, match="step.step: expected an integer"):
            led.emit(E.Step(step="3", dt=0.5))  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="no keyword fields"):
            led.emit(E.Step(step=3, dt=0.5), loss=1.0)  # type: ignore[call-arg]
        with pytest.raises(E.EventSchemaError, match="worker pipe only"):
            led.emit(E.Heartbeat(step=3))
    assert [e["step"] for e in read_events(tmp_path)] == [3]  # nothing invalid was written
    with pytest.raises(E.EventSchemaError):
        NullSink().emit("step", stepp=1)  # ranks that discard events still validate them


def test_pipe_sink_stamps_the_rank_and_keeps_the_workers_time() -> None:
    r, w = os.pipe()
    try:
        PipeSink(w, rank=3).emit(E.Spike(step=12, reason="loss spike", value=1e3, t=100.0))
        rec = json.loads(os.read(r, 4096))
    finally:
        os.close(r)
        os.close(w)
    assert rec == {"ev": "spike", "v": 1, "t": 100.0, "mono": rec["mono"], "rank": 3, "step": 12,
                   "reason": "loss spike", "value": 1e3}  # fmt: skip
    assert E.make_event(rec.pop("ev"), **rec) == E.parse_event({"ev": "spike", **rec})  # relayed as it came


def test_a_newer_ledger_does_not_crash_an_older_reader(tmp_path) -> None:
    b = LedgerBuilder(t0=0.0)
    b.start().steps(3)
    b.fail("crash", detect_s=0.1, teardown_s=0.1)
    b.recover().steps(2).end()
    lines = [json.dumps(e) for e in b.events]
    failure = next(e for e in b.events if e["ev"] == "failure")
    newer = [
        {"ev": "gpu_throttled", "v": 2, "t": 3.5, "node": "n1"},  # a kind this version lacks
        {**failure, "v": 2, "t": failure["t"] + 30.0, "cause": "oom", "oom_bytes": 1},  # new value, field
        {"ev": "step", "v": 2, "t": 4.0, "dt": 1.0},  # does not fit: no step index
    ]
    (tmp_path / "ledger.jsonl").write_text("\n".join(lines + [json.dumps(x) for x in newer]) + "\n")
    typed = read_typed(tmp_path)
    unknown = [e for e in typed if isinstance(e, E.UnknownEvent)]
    assert [(u.ev, u.problem) for u in unknown] == [
        ("gpu_throttled", "unknown event kind 'gpu_throttled'"),
        ("step", "step lacks field step"),
    ]
    oom = [e for e in typed if isinstance(e, E.Failure) and e.cause == "oom"]
    assert len(oom) == 1 and type(oom[0].cause) is str
    s = metrics.summarize(read_events(tmp_path))
    assert s["failures"]["by_cause"] == {"crash": 1, "oom": 1}
    assert s["steps"]["executed"] == 5  # the step line that did not fit is skipped
    with pytest.raises(E.EventSchemaError):
        E.parse_event(newer[0], strict=True)
    with pytest.raises(E.EventSchemaError):
        E.parse_event(newer[1], strict=True)


def test_lines_written_before_the_version_field_read_as_version_1() -> None:
    old = {"ev": "restore", "t": 5.0, "mono": 1.0, "session": "x", "rank": 0, "step": 4, "load_s": 0.5,
           "source": "local", "fresh": False}  # fmt: skip
    ev = E.parse_event(old, strict=True)
    assert isinstance(ev, E.Restore) and ev.source is E.RestoreSource.LOCAL and ev.step == 4


def test_a_record_without_mono_is_written_back_without_it(tmp_path) -> None:
    # A worker's record that lacks `mono` reads as NaN; forwarding it must not write `NaN` (not JSON).
    ev = E.parse_event({"ev": "restore", "t": 5.0, "rank": 1, "step": 4, "load_s": 0.5, "source": "local"})
    assert isinstance(ev, E.Restore) and ev.mono != ev.mono
    assert "mono" not in E.to_record(ev)
    with Ledger(tmp_path) as led:
        led.emit(ev)
    (line,) = [x for p in tmp_path.rglob("*.jsonl") for x in p.read_text().splitlines()]
    json.loads(line, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c} in {line}"))
    (back,) = read_typed(tmp_path)
    assert isinstance(back, E.Restore) and back.step == 4 and back.mono != back.mono


def test_walk_takes_typed_events_or_raw_records_alike() -> None:
    b = LedgerBuilder(t0=0.0)
    b.start().steps(4).checkpoint().steps(2)
    b.fail("spike", rank=0).recover(rollback="skip").steps(2).end()
    raw = walk(b.events)
    typed = walk([E.parse_event(e) for e in b.events])
    assert raw == typed
    assert [type(e) for e in raw.rollbacks] == [E.Rollback] and len(raw.skips) == 1
    assert raw.events(E.Spike)[0].step == 6


def test_the_registry_and_all_follow_from_the_declarations() -> None:
    declared = [c for c in vars(E).values() if isinstance(c, type) and issubclass(c, E.Event)]
    kinds = [c for c in declared if c not in (E.Event, E.UnknownEvent)]
    assert {c.kind: c for c in kinds} == E.EVENT_TYPES and len(kinds) == len(E.EVENT_TYPES)
    assert all(c.__slots__ for c in kinds)  # the registry holds the dataclass, not the class it replaced
    assert set(E.__all__) <= set(vars(E)) and len(E.__all__) == len(set(E.__all__))
    used_enums = {
        a
        for c in kinds
        for tp in typing.get_type_hints(c).values()
        for a in (typing.get_args(tp) or (tp,))
        if isinstance(a, type) and issubclass(a, enum.Enum)
    }
    assert {c.__name__ for c in declared} | {e.__name__ for e in used_enums} <= set(E.__all__)


def test_a_kind_is_declared_once() -> None:
    with pytest.raises(TypeError, match="'step' declared twice: Step, Again"):

        @E.event("step")
        class Again(E.Event):
            pass

    assert E.EVENT_TYPES["step"] is E.Step


def test_a_kind_set_in_the_class_body_is_refused() -> None:
    with pytest.raises(TypeError, match="Old: declare an event's kind with @event"):

        class Old(E.Event):
            kind: typing.ClassVar[str] = "old"

    assert "old" not in E.EVENT_TYPES

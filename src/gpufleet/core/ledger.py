"""The append-only event ledger: one JSONL file per run directory.

Why JSONL and not SQLite: every event is one ``write()`` of one line to a file opened with
``O_APPEND``, so several processes (the supervisor, rank 0's checkpoint thread in standalone mode)
can append without a lock, a crash leaves at most one torn last line (which readers skip), the file
can be tailed and grepped while a run is live, and it behaves the same on a shared filesystem where
SQLite's locking does not. The ledger is the single source of every reliability number.

Each event is one typed object of :mod:`gpufleet.core.events` (``emit(E.Step(step=3, dt=0.1))``),
written as one JSON line with ``ev`` (its kind), ``v`` (the format version), ``t`` (wall clock,
seconds since the epoch), ``mono`` (``time.monotonic()``, comparable between processes on one host)
and ``session`` (one ``gpufleet run`` invocation); the rest depends on the kind. The older form
``emit("step", step=3, dt=0.1)`` still works: it builds the same typed event through the registry,
so an unknown kind or field raises :class:`~gpufleet.core.events.EventSchemaError` there too.

``read_events`` returns the raw records (dicts); ``read_typed`` the typed events
(:func:`~gpufleet.core.events.parse_event`, lenient: see docs/ledger.md for the version policy).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from gpufleet.core.events import Event, EventSchemaError, make_event, parse_event, to_record

__all__ = [
    "EventSink",
    "Ledger",
    "PipeSink",
    "NullSink",
    "as_event",
    "iter_events",
    "read_events",
    "read_typed",
    "LEDGER_NAME",
]

LEDGER_NAME = "ledger.jsonl"


class EventSink(Protocol):
    """Anything that takes events: the ledger itself, or a pipe to the supervisor.

    ``emit(event)`` takes a typed event; ``emit("kind", **fields)`` builds one through the registry.
    """

    def emit(self, event: Event | str, /, **fields: Any) -> None: ...


def as_event(event: Event | str, fields: dict[str, Any]) -> Event:
    """The typed event an ``emit`` call stands for (validated either way)."""
    if isinstance(event, Event):
        if fields:
            raise TypeError("emit(event) takes no keyword fields; set them on the event")
        return event
    return make_event(event, **fields)


def _encode(event: Event, **envelope: Any) -> bytes:
    """One JSON line; ``envelope`` (session, rank) fills those fields when the event left them None."""
    record = to_record(event)
    for k, v in envelope.items():
        if v is not None and record.get(k) is None:
            record[k] = v
    return (json.dumps(record, separators=(",", ":"), default=str) + "\n").encode()


class Ledger:
    """Appends events to ``RUN_DIR/ledger.jsonl``. Safe to share between processes on one host."""

    def __init__(self, run_dir: str | os.PathLike[str], session: str | None = None, fsync: bool = False):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / LEDGER_NAME
        self.session = session
        self._fsync = fsync
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def emit(self, event: Event | str, /, **fields: Any) -> None:
        ev = as_event(event, fields)
        if not ev.in_ledger:
            raise EventSchemaError(f"{ev.kind} events travel on the worker pipe only, never in the ledger")
        self.write_raw(_encode(ev, session=self.session))

    def write_raw(self, line: bytes) -> None:
        """Append one already-encoded event line (used when relaying events from workers)."""
        if not line.endswith(b"\n"):
            line += b"\n"
        os.write(self._fd, line)
        if self._fsync:
            os.fsync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PipeSink:
    """Sends events from a worker to its supervisor over an inherited pipe (one line per event).

    Lines are shorter than PIPE_BUF, so writes from threads of one worker never interleave.
    """

    def __init__(self, fd: int, rank: int):
        self._fd = fd
        self._rank = rank

    def emit(self, event: Event | str, /, **fields: Any) -> None:
        line = _encode(as_event(event, fields), rank=self._rank)
        try:
            os.write(self._fd, line)
        except BrokenPipeError:
            # The supervisor is gone; it will kill us shortly. Events are best-effort from here.
            pass


class NullSink:
    """Discards events (ranks other than 0 in standalone mode), after the same validation."""

    def emit(self, event: Event | str, /, **fields: Any) -> None:
        as_event(event, fields)


def iter_events(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Yield events in file order, skipping a torn or garbled line rather than failing the read."""
    p = Path(path)
    if p.is_dir():
        p = p / LEDGER_NAME
    if not p.exists():
        return
    with open(p, "rb") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                break  # torn last line of a crashed writer
            try:
                rec = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):  # garbled: binary garbage is not UTF-8
                continue
            if isinstance(rec, dict) and "ev" in rec:
                yield rec


def read_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All events of a run directory (or of a ledger file), as raw records."""
    return list(iter_events(path))


def read_typed(path: str | os.PathLike[str]) -> list[Event]:
    """All events of a run directory (or of a ledger file), typed (lenient :func:`parse_event`)."""
    return [parse_event(rec) for rec in iter_events(path)]

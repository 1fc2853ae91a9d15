"""Read a ledger incrementally: remember the byte offset, parse only what was appended since.

A scrape of a live run costs the new lines only. A torn last line (a writer mid-``write``) stays in
the buffer until its newline arrives. A file that shrank (replaced, truncated) is read again from
the start, and :attr:`LedgerTail.generation` changes so that callers drop what they derived from it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from gpufleet.core import events as E
from gpufleet.core.ledger import LEDGER_NAME

__all__ = ["LedgerTail"]

_CHUNK = 1 << 20


class LedgerTail:
    """The typed events of one ledger file, read by offset (``poll()`` returns the new ones)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        p = Path(path)
        self.path = p / LEDGER_NAME if p.is_dir() or not p.suffix else p
        self.events: list[E.Event] = []
        self.offset = 0
        self.generation = 0
        self._partial = b""
        self._ino: int | None = None

    def poll(self) -> list[E.Event]:
        """Read what was appended since the last call; the events it holds, typed (lenient)."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            if self.offset:
                self._reset()
            return []
        if st.st_size < self.offset or (self._ino is not None and st.st_ino != self._ino):
            self._reset()
        self._ino = st.st_ino
        if st.st_size == self.offset:
            return []
        new: list[E.Event] = []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            while True:
                chunk = f.read(_CHUNK)
                if not chunk:
                    break
                self.offset += len(chunk)
                data = self._partial + chunk
                lines = data.split(b"\n")
                self._partial = lines.pop()  # b"" after a complete line; else a torn tail
                for raw in lines:
                    ev = _parse(raw)
                    if ev is not None:
                        new.append(ev)
        self.events.extend(new)
        return new

    def _reset(self) -> None:
        self.events, self.offset, self._partial = [], 0, b""
        self.generation += 1


def _parse(raw: bytes) -> E.Event | None:
    if not raw.strip():
        return None
    try:
        rec = json.loads(raw)
    except json.JSONDecodeError:
        return None
    if not isinstance(rec, dict) or "ev" not in rec:
        return None
    ev = E.parse_event(rec)
    return None if isinstance(ev, E.UnknownEvent) else ev

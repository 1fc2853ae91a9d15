"""Server-sent events from an OpenAI-compatible streaming response, one line at a time.

Pure and synchronous: :class:`StreamState` gets each line with the time it arrived and keeps the
times of the *non-empty* content chunks (empty chunks, role-only deltas and usage-only chunks are
not tokens), the text, the ``usage`` object, the finish reason, and the first error:

* ``stream_error``: the server sent an error object (``{"error": ...}``) inside the stream;
* ``malformed_sse``: a line that is not an SSE field, or a ``data:`` payload that is not JSON.

Events are dispatched on the blank line that ends them (multi-line ``data:`` is joined with ``\\n``),
and at the end of the stream for a last event without one.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["StreamState"]

_FIELDS = (b"event", b"id", b"retry")


class StreamState:
    """What one streamed response said. Feed lines (without or with their line ending)."""

    __slots__ = ("content_times", "parts", "usage", "finish_reason", "done", "error", "_data", "_t")

    def __init__(self) -> None:
        self.content_times: list[float] = []
        self.parts: list[str] = []
        self.usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self.done = False
        self.error: tuple[str, str] | None = None  # (kind, message)
        self._data: list[bytes] = []
        self._t = 0.0

    def feed(self, line: bytes, now: float) -> None:
        line = line.rstrip(b"\r\n")
        if not line:
            self._dispatch()
            return
        if self.done or self.error is not None:
            return
        if line.startswith(b"data:"):
            if not self._data:
                self._t = now
            self._data.append(line[6:] if line[5:6] == b" " else line[5:])
        elif line.startswith(b":"):
            return  # comment / keep-alive
        else:
            name = line.split(b":", 1)[0]
            if name not in _FIELDS:
                self._fail("malformed_sse", f"not an SSE line: {line[:60]!r}")

    def close(self) -> None:
        """The stream ended: dispatch a last event that had no blank line after it."""
        self._dispatch()

    def _fail(self, kind: str, msg: str) -> None:
        if self.error is None:
            self.error = (kind, msg)

    def _dispatch(self) -> None:
        if not self._data:
            return
        payload = b"\n".join(self._data).strip()
        self._data = []
        if self.done or self.error is not None or not payload:
            return
        if payload == b"[DONE]":
            self.done = True
            return
        try:
            obj = json.loads(payload)
        except (ValueError, RecursionError):
            self._fail("malformed_sse", f"data is not JSON: {payload[:60]!r}")
            return
        if not isinstance(obj, dict):
            self._fail("malformed_sse", f"data is not a JSON object: {payload[:60]!r}")
            return
        if "error" in obj and obj["error"]:
            err = obj["error"]
            msg = err.get("message", err) if isinstance(err, dict) else err
            self._fail("stream_error", str(msg)[:200])
            return
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
        choices = obj.get("choices")
        if not choices or not isinstance(choices, list) or not isinstance(choices[0], dict):
            return
        ch = choices[0]
        text = ""
        delta = ch.get("delta")
        if isinstance(delta, dict):
            for key in ("content", "reasoning_content", "reasoning"):
                v = delta.get(key)
                if isinstance(v, str):
                    text += v
        elif isinstance(ch.get("text"), str):
            text = ch["text"]
        if text:
            self.content_times.append(self._t)
            self.parts.append(text)
        if ch.get("finish_reason"):
            self.finish_reason = str(ch["finish_reason"])

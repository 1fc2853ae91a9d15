"""Which errors mean "a peer is gone" (survivable in-process) and which make this process suspect.

Shared by the in-process harness (train/inprocess.py), which catches what escapes the script, and the
run API (train/run.py), which survives a peer's death in place at the step boundary.
"""

from __future__ import annotations

__all__ = ["survivable"]

# Messages of collective failures caused by a peer's death (gloo's pair errors, NCCL's remote errors).
_PEER_LOST = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "remote worker crashing",
    "remote process exited",
    "ncclremoteerror",
    "nccl communicator was aborted",
    "connection refused",
)
# Errors that make the process itself suspect: never survived in-process.
_FATAL = ("cuda error", "illegal memory access", "out of memory", "cudnn_status", "cublas_status")


def survivable(exc: BaseException) -> bool:
    """True when ``exc`` (or an exception in its cause/context chain) is a collective failing because a
    peer is gone, and nothing in the chain is a device fault."""
    seen: set[int] = set()
    peer_lost = False
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (KeyboardInterrupt, SystemExit, MemoryError)):
            return False
        text = f"{type(e).__name__} {e}".lower()
        if any(s in text for s in _FATAL):
            return False
        if isinstance(e, RuntimeError) and any(s in text for s in _PEER_LOST):
            peer_lost = True
        if type(e).__name__ in ("DistNetworkError", "DistBackendError"):
            peer_lost = True
        e = e.__cause__ or e.__context__
    return peer_lost

"""Which errors a surviving rank may survive in-process (gpufleet.train.inprocess.survivable)."""

from __future__ import annotations

import pytest

from gpufleet.train.inprocess import survivable

GLOO_PEER_GONE = (
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4242. "
    "This is typically caused by a remote worker crashing."
)


class DistBackendError(RuntimeError):  # torch.distributed's name, raised by newer process groups
    pass


def _chained(outer: BaseException, inner: BaseException) -> BaseException:
    try:
        try:
            raise inner
        except BaseException as e:
            raise outer from e
    except BaseException as e:
        return e


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError(GLOO_PEER_GONE),
        RuntimeError("Connection reset by peer"),
        DistBackendError("NCCL error: remote process exited or there was a network error, NCCLRemoteError"),
        _chained(ValueError("while stepping"), RuntimeError(GLOO_PEER_GONE)),  # the user wrapped it
    ],
)
def test_a_collective_failing_on_a_dead_peer_is_survivable(exc):
    assert survivable(exc)


@pytest.mark.parametrize(
    "exc",
    [
        ValueError("shape mismatch"),  # the script's own bug: a full restart (or the same bug again)
        RuntimeError("CUDA error: an illegal memory access was encountered"),
        _chained(RuntimeError(GLOO_PEER_GONE), RuntimeError("CUDA error: device-side assert triggered")),
        MemoryError(),
        KeyboardInterrupt(),
        SystemExit(1),
    ],
)
def test_anything_else_is_not(exc):
    assert not survivable(exc)

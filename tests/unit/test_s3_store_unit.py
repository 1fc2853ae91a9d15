"""S3Store pieces that need no server: URL parsing, error classification, backoff."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpufleet.checkpoint.storage.s3 import S3Store
from gpufleet.checkpoint.storage.s3.client import parse_s3_url
from gpufleet.checkpoint.storage.s3.download import RANGE_MAX, RANGE_MIN, plan_range_size
from gpufleet.core.errors import RetryableStorageError, TerminalStorageError, UsageError


@pytest.mark.parametrize(
    "url",
    [
        "",
        "bucket/prefix",
        "http://bucket/x",
        "s3://",
        "s3://A_Upper/x",
        "s3://ab/x",
        "s3://b/../x",
        "s3://bkt/a//b",
    ],
)
def test_bad_url_is_usage_error(url: str) -> None:
    with pytest.raises(UsageError):
        parse_s3_url(url)
    with pytest.raises(UsageError):
        S3Store(url)


def test_parse_url() -> None:
    assert parse_s3_url("s3://my-bucket") == ("my-bucket", "")
    assert parse_s3_url("s3://my-bucket/") == ("my-bucket", "")
    assert parse_s3_url("s3://my-bucket/a/b/") == ("my-bucket", "a/b")


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> S3Store:
    pytest.importorskip("boto3")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "very-secret-value")
    return S3Store("s3://bucket/run1", "http://127.0.0.1:1", max_attempts=4, backoff_base=0.5, backoff_cap=3)


def client_error(code: str, status: int):  # noqa: ANN201
    from botocore.exceptions import ClientError

    resp = {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}}
    return ClientError(resp, "PutObject")


@pytest.mark.parametrize(
    ("code", "status", "kind"),
    [
        ("SlowDown", 503, RetryableStorageError),
        ("InternalError", 500, RetryableStorageError),
        ("RequestTimeout", 400, RetryableStorageError),
        ("Whatever", 502, RetryableStorageError),
        ("AccessDenied", 403, TerminalStorageError),
        ("SignatureDoesNotMatch", 403, TerminalStorageError),
        ("NoSuchBucket", 404, TerminalStorageError),
        ("404", 404, TerminalStorageError),
    ],
)
def test_classify_client_errors(store: S3Store, code: str, status: int, kind: type) -> None:
    assert type(store.classify(client_error(code, status), "put", "k")) is kind


def test_classify_transport_and_local_errors(store: S3Store) -> None:
    from botocore.exceptions import EndpointConnectionError, NoCredentialsError, ReadTimeoutError

    assert isinstance(
        store.classify(EndpointConnectionError(endpoint_url="x"), "get", "k"), RetryableStorageError
    )
    assert isinstance(store.classify(ReadTimeoutError(endpoint_url="x"), "get", "k"), RetryableStorageError)
    assert isinstance(store.classify(NoCredentialsError(), "get", "k"), TerminalStorageError)
    assert isinstance(
        store.classify(OSError(28, "No space left on device"), "get", "k"), TerminalStorageError
    )
    assert store.classify(ValueError("bug"), "get", "k") is None


def test_call_retries_with_bounded_backoff_then_gives_up(store: S3Store) -> None:
    sleeps: list[float] = []
    store._sleep = sleeps.append
    calls = []

    def always_throttled() -> None:
        calls.append(1)
        raise client_error("SlowDown", 503)

    with pytest.raises(RetryableStorageError, match="gave up after 4 attempts"):
        store.call("put", "k", always_throttled)
    assert len(calls) == 4 and len(sleeps) == 3
    for attempt, s in enumerate(sleeps):
        d = min(3.0, 0.5 * 2**attempt)
        assert d / 2 <= s <= d


def test_call_terminal_is_not_retried(store: S3Store) -> None:
    store._sleep = lambda s: pytest.fail("must not sleep")
    calls = []

    def denied() -> None:
        calls.append(1)
        raise client_error("AccessDenied", 403)

    with pytest.raises(TerminalStorageError, match="AccessDenied"):
        store.call("put", "k", denied)
    assert calls == [1]


def test_call_recovers(store: S3Store) -> None:
    store._sleep = lambda s: None
    outcomes = [client_error("SlowDown", 503), client_error("InternalError", 500), "ok"]

    def flaky() -> str:
        o = outcomes.pop(0)
        if isinstance(o, Exception):
            raise o
        return o

    assert store.call("get", "k", flaky) == "ok"


def test_repr_hides_credentials(store: S3Store) -> None:
    assert "very-secret-value" not in repr(store) and "AKIDEXAMPLE" not in repr(store)


def test_empty_objects_are_created_without_a_request(store: S3Store, tmp_path: Path) -> None:
    from gpufleet.checkpoint.storage.s3.client import _Job
    from gpufleet.checkpoint.storage.s3.download import fetch

    # The endpoint is closed (port 1): any GET would fail. Zero-byte objects need none.
    stale = tmp_path / "b.bin"
    stale.write_bytes(b"left over from an older download")
    fetch(store, [_Job("run1/step_1/a.bin", tmp_path / "a.bin", 0), _Job("run1/step_1/b.bin", stale, 0)])
    assert (tmp_path / "a.bin").read_bytes() == b"" and stale.read_bytes() == b""


MiB = 1024 * 1024


@pytest.mark.parametrize(
    ("total", "workers", "want"),
    [
        (0, 8, RANGE_MIN),  # nothing or little to fetch: small objects go whole
        (3 * MiB, 8, RANGE_MIN),
        (252 * MiB, 8, 32 * MiB),  # the benchmark's 4 x 64 MiB: two ranges per object, 8 in all
        (252 * MiB + 1, 8, 32 * MiB),  # a share rounds up to whole MiB
        (256 * MiB + 1, 8, 33 * MiB),
        (10 * 1024 * MiB, 8, RANGE_MAX),  # large checkpoints: ranges stay bounded (a retry's cost)
        (100 * MiB, 0, RANGE_MAX),  # no workers given: one worker
    ],
)
def test_adaptive_range_plan(total: int, workers: int, want: int) -> None:
    assert plan_range_size(total, workers) == want


def test_range_size_must_be_positive() -> None:
    with pytest.raises(UsageError, match="range_size"):
        S3Store("s3://bucket/x", "http://127.0.0.1:1", range_size=0)


def test_part_buffers_are_reused_across_uploads_and_bounded() -> None:
    from gpufleet.checkpoint.storage.s3.upload import _PartBuffers

    pool = _PartBuffers(cap=2)
    a, b, c = pool.take(1024), pool.take(1024), pool.take(1024)
    assert len(a) == 1024 and a is not b
    pool.give([a, b, c, bytearray(512)])  # one over the cap for 1024: dropped
    got = {id(pool.take(1024)), id(pool.take(1024))}
    assert got == {id(a), id(b)}
    fresh = pool.take(1024)
    assert fresh is not a and fresh is not b and len(pool.take(512)) == 512

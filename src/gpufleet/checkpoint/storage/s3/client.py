"""Checkpoint tier on any S3-compatible object store (AWS S3, SeaweedFS, MinIO, Ceph RGW, ...).

Library: **boto3** (with botocore and s3transfer). It is the de-facto standard S3 client, so every
S3-compatible server is tested against it; botocore brings retry modes with a retry quota and the
credential chain (env, profile, instance role, SSO); s3transfer brings a multipart transfer manager
with parallel parts (used for uploads). boto3 is the ``s3`` extra and is imported here lazily,
inside :class:`S3Client`, so ``import gpufleet`` in a training rank stays cheap.

The store lists, reads and deletes itself; its directory transfers live beside it: ranged,
parallel downloads in :mod:`~gpufleet.checkpoint.storage.s3.download`, whole-directory and
streaming multipart uploads in :mod:`~gpufleet.checkpoint.storage.s3.upload`. Both go through
this client, its retries and its error classification.

Two retry layers:

- botocore ``standard`` retries each HTTP request (each part) a few times;
- on top, every operation (one file upload, one download range, one listing, one delete batch)
  gets our own bounded exponential backoff with jitter for throttling (SlowDown, 503), 5xx,
  connection errors and timeouts. A download range that broke mid-body resumes from the last byte
  written, not from its start. When the attempts run out it raises
  :class:`~gpufleet.core.errors.RetryableStorageError`. Auth failures, a missing bucket or key and
  local disk errors raise :class:`~gpufleet.core.errors.TerminalStorageError` at once.

Ordering: ``upload_dir`` uploads ``manifest.json`` only after every other file has landed, and
``delete_prefix`` deletes it first, so a half-uploaded or half-deleted checkpoint is never visible
to ``list_prefixes``. The engine calls this from a background thread after the local commit, never
from inside a collective.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from gpufleet.core.env import Platform
from gpufleet.core.errors import RetryableStorageError, StorageError, TerminalStorageError, UsageError

__all__ = ["S3Client", "parse_s3_url", "MANIFEST_NAME"]

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
MiB = 1024 * 1024
T = TypeVar("T")

# Error codes worth retrying even when the HTTP status alone would not say so.
_RETRYABLE_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestLimitExceeded",
        "TooManyRequestsException",
        "ProvisionedThroughputExceededException",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
        "BadDigest",
        "IncompleteBody",
        "OperationAborted",
    }
)
_RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})


def parse_s3_url(url: str) -> tuple[str, str]:
    """Split ``s3://bucket/some/prefix`` into ``("bucket", "some/prefix")``; raise UsageError if bad."""
    if not isinstance(url, str) or not url.startswith("s3://"):
        raise UsageError(f"not an s3:// URL: {url!r} (expected s3://bucket/prefix)")
    rest = url[len("s3://") :]
    bucket, _, prefix = rest.partition("/")
    ok_chars = set("abcdefghijklmnopqrstuvwxyz0123456789.-_")
    if not (3 <= len(bucket) <= 63) or not set(bucket) <= ok_chars or not bucket[0].isalnum():
        raise UsageError(f"bad bucket name in {url!r}: 3-63 lowercase letters, digits, '.', '-', '_'")
    prefix = prefix.strip("/")
    if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
        raise UsageError(f"bad key prefix in {url!r}: empty, '.' or '..' path segments")
    return bucket, prefix


def _clean_rel(rel: str, what: str) -> str:
    rel = rel.strip("/")
    if not rel or any(p in ("", ".", "..") for p in rel.split("/")):
        raise UsageError(f"bad {what} {rel!r}: must be a relative key without '.', '..' or '//'")
    return rel


@dataclass
class _Job:
    key: str
    path: Path
    size: int
    etag: str = ""  # as listed: downloads send If-Match so every range is of the same object


_CLIENTS: dict[tuple[Any, ...], Any] = {}
_CLIENTS_LOCK = threading.Lock()


def _shared_client(key: tuple[Any, ...] | None, make: Callable[[], Any]) -> Any:
    """A botocore client per (endpoint, credentials, settings), shared by every store that asks.

    Creating one loads and parses botocore's service model: 0.05-0.15 CPU-s each time, paid by
    every store (one per upload URL, a fresh one per restore) before a single byte moves."""
    if key is None:
        return make()
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(key)
        if client is None:
            client = _CLIENTS[key] = make()
        return client


class S3Client:
    """One ``s3://bucket/prefix``: the pooled boto3 client, its retries and error classes; list, read
    and delete. :class:`~gpufleet.checkpoint.storage.s3.S3Store` adds the directory transfers."""

    def __init__(
        self,
        url: str,
        endpoint_url: str | None = None,
        *,
        max_attempts: int = 8,
        backoff_base: float = 0.25,
        backoff_cap: float = 8.0,
        botocore_max_attempts: int = 3,
        multipart_threshold: int = 16 * MiB,
        multipart_chunksize: int = 16 * MiB,
        max_concurrency: int = 8,
        range_size: int | None = None,
        connect_timeout: float = 5.0,
        read_timeout: float = 60.0,
    ) -> None:
        self.bucket, self.prefix = parse_s3_url(url)
        self.url = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        if max_attempts < 1 or botocore_max_attempts < 1:
            raise UsageError("max_attempts must be >= 1")
        if backoff_base < 0 or backoff_cap < 0:
            raise UsageError("backoff_base and backoff_cap must be >= 0")
        if range_size is not None and range_size < 1:
            raise UsageError("range_size must be >= 1 (or None: adaptive)")
        self.range_size = range_size
        self.endpoint_url = (
            endpoint_url or Platform.AWS_ENDPOINT_URL_S3.get() or Platform.AWS_ENDPOINT_URL.get() or None
        )
        self.max_attempts = max_attempts
        self.backoff_base = backoff_base
        self.backoff_cap = backoff_cap
        self._sleep: Callable[[float], None] = time.sleep
        self._rng = random.Random()

        import boto3  # lazy: the s3 extra
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        session = boto3.session.Session()  # a private session: the default one is not thread-safe
        region = session.region_name or "us-east-1"
        config = Config(
            # No SHA-256 of every body for SigV4 over plain http (botocore's default there):
            # requests keep their CRC32 checksum, which the server verifies, at a fraction of
            # the CPU. GETs do not ask for a response checksum: ranges carry none anyway, and
            # the checkpoint layer verifies every file's xxh3 against its manifest.
            s3={"addressing_style": "path", "payload_signing_enabled": False},
            response_checksum_validation="when_required",
            retries={"mode": "standard", "total_max_attempts": botocore_max_attempts},
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            max_pool_connections=max_concurrency * 2 + 4,
        )
        creds = session.get_credentials()
        shared = None
        if creds is not None:  # same endpoint, credentials and settings: one client (thread-safe)
            frozen = tuple(creds.get_frozen_credentials())
            shared = (self.endpoint_url, region, frozen, botocore_max_attempts, connect_timeout, read_timeout)
            shared += (max_concurrency,)
        self.client = _shared_client(
            shared,
            lambda: session.client("s3", endpoint_url=self.endpoint_url, region_name=region, config=config),
        )
        self.transfer_config = TransferConfig(
            multipart_threshold=multipart_threshold,
            multipart_chunksize=multipart_chunksize,
            max_concurrency=max_concurrency,
            use_threads=True,
            preferred_transfer_client="classic",
        )

    def __repr__(self) -> str:  # credentials live only inside the boto client; never shown
        return f"{type(self).__name__}(url={self.url!r}, endpoint_url={self.endpoint_url!r})"

    # ----------------------------------------------------------------------------- public API
    def list_prefixes(self) -> list[str]:
        """Sub-prefixes directly under the URL (e.g. ``step_00000100``) that hold a manifest.json."""
        root = f"{self.prefix}/" if self.prefix else ""
        found = []
        for key, _size, _etag in self.call("list", root, lambda: list(self.list_objects(root))):
            rest = key[len(root) :]
            name, _, tail = rest.partition("/")
            if name and tail == MANIFEST_NAME:
                found.append(name)
        return sorted(found)

    def read_json(self, key: str) -> dict[str, Any]:
        """Read and parse one JSON object; ``key`` is relative to the URL."""
        full = self.key_for(_clean_rel(key, "key"))

        def get() -> bytes:
            body = self.client.get_object(Bucket=self.bucket, Key=full)["Body"]
            try:
                return body.read()
            finally:
                body.close()

        data = self.call("get", full, get)
        try:
            doc = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise TerminalStorageError(f"s3://{self.bucket}/{full} is not valid JSON: {e}") from e
        if not isinstance(doc, dict):
            raise TerminalStorageError(f"s3://{self.bucket}/{full} is JSON but not an object")
        return doc

    def delete_prefix(self, prefix: str) -> None:
        """Delete ``<url>/<prefix>/``: the manifest FIRST (the checkpoint vanishes), then the rest."""
        base = self.key_for(_clean_rel(prefix, "prefix"))
        manifest = f"{base}/{MANIFEST_NAME}"
        self.call("delete", manifest, lambda: self.client.delete_object(Bucket=self.bucket, Key=manifest))
        while True:
            keys = [k for k, _, _ in self.call("list", base, lambda: list(self.list_objects(base + "/")))]
            if not keys:
                return
            for i in range(0, len(keys), 1000):
                batch = keys[i : i + 1000]
                self.call("delete", f"{base}/ ({len(batch)} objects)", lambda b=batch: self._delete_batch(b))

    # ------------------------------------------------- what the download and upload modules build on
    def key_for(self, rel: str) -> str:
        """The full object key of ``rel`` (relative to the URL's prefix)."""
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def list_objects(self, prefix: str) -> Iterator[tuple[str, int, str]]:
        """(key, size, ETag) of every object under ``prefix``."""
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                yield obj["Key"], int(obj.get("Size", 0)), str(obj.get("ETag") or "")

    def _delete_batch(self, keys: list[str]) -> None:
        resp = self.client.delete_objects(
            Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in keys], "Quiet": True}
        )
        errors = resp.get("Errors") or []
        if errors:
            first = errors[0]
            msg = f"{len(errors)} of {len(keys)} deletes failed, e.g. {first.get('Key')}: {first.get('Code')}"
            if all(e.get("Code") in _RETRYABLE_CODES for e in errors):
                raise RetryableStorageError(msg)
            raise TerminalStorageError(msg)

    def _backoff(self, attempt: int) -> float:
        """Exponential backoff with 'equal jitter': half fixed, half random, capped."""
        d = min(self.backoff_cap, self.backoff_base * (2**attempt))
        return d / 2 + self._rng.uniform(0, d / 2)

    def call(self, op: str, what: str, fn: Callable[[], T]) -> T:
        """Run one whole-object operation with bounded backoff; classify what escapes."""
        last: StorageError | None = None
        for attempt in range(self.max_attempts):
            try:
                return fn()
            except Exception as e:  # noqa: BLE001 - classified right here; anything unknown re-raises
                err = self.classify(e, op, what)
                if err is None:
                    raise
                if isinstance(err, TerminalStorageError):
                    raise err from e
                last = err
            self.wait_to_retry(attempt, op, what, last)
        raise RetryableStorageError(f"{last} (gave up after {self.max_attempts} attempts)") from last

    # -- multipart pieces, with the same retries (StreamingUpload's parts) ------------------------
    @property
    def part_size(self) -> int:
        """Bytes per multipart part (S3's 5 MiB minimum at least)."""
        return max(5 * MiB, self.transfer_config.multipart_chunksize)

    @property
    def concurrency(self) -> int:
        """Parallel requests one transfer may have in flight."""
        return max(1, self.transfer_config.max_request_concurrency)

    def create_multipart(self, key: str) -> str:
        """Open a multipart upload of ``key``; its id."""
        resp = self.call(
            "upload", key, lambda: self.client.create_multipart_upload(Bucket=self.bucket, Key=key)
        )
        return str(resp["UploadId"])

    def upload_part(self, key: str, upload_id: str, number: int, body: Any) -> str:
        """Send part ``number`` of an open multipart upload; its ETag."""
        resp = self.call(
            "upload",
            f"{key} part {number}",
            lambda: self.client.upload_part(
                Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=body
            ),
        )
        return str(resp["ETag"])

    def complete_multipart(self, key: str, upload_id: str, etags: list[tuple[int, str]]) -> None:
        """Complete a multipart upload from its parts' (number, ETag)."""
        parts = [{"PartNumber": n, "ETag": e} for n, e in etags]
        self.call(
            "upload",
            key,
            lambda: self.client.complete_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
            ),
        )

    def abort_multipart(self, key: str, upload_id: str) -> None:
        """Abort a multipart upload (one attempt: S3 lifecycle rules reap what this misses)."""
        self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)

    def wait_to_retry(self, attempt: int, op: str, what: str, err: StorageError | None) -> None:
        """Sleep the backoff after failed ``attempt`` (logged), unless it was the last one."""
        if attempt + 1 >= self.max_attempts:
            return
        delay = self._backoff(attempt)
        log.warning(
            "s3 %s %s: %s; retry %d/%d in %.2fs", op, what, err, attempt + 1, self.max_attempts - 1, delay
        )
        self._sleep(delay)

    def classify(self, exc: BaseException, op: str, what: str) -> StorageError | None:
        """Map an exception to Retryable/TerminalStorageError, or None for one we do not know."""
        from botocore import exceptions as bx
        from s3transfer.exceptions import RetriesExceededError

        where = f"s3 {op} s3://{self.bucket}/{what}"
        if isinstance(exc, StorageError):
            return exc
        if isinstance(exc, bx.ClientError):
            err = exc.response.get("Error", {}) or {}
            code = str(err.get("Code", ""))
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            msg = f"{where}: HTTP {status} {code}: {err.get('Message', '')}".rstrip(": ")
            if code in _RETRYABLE_CODES or status in _RETRYABLE_STATUS or status >= 500:
                return RetryableStorageError(msg)
            return TerminalStorageError(msg)
        retryable = (
            bx.HTTPClientError,  # connection closed, read timeout, response streaming
            bx.ConnectionError,  # endpoint unreachable, connect timeout
            bx.IncompleteReadError,
            bx.ChecksumError,
            bx.FlexibleChecksumError,
            RetriesExceededError,  # s3transfer's own download stream retries ran out
            ConnectionError,
            TimeoutError,
        )
        if isinstance(exc, retryable):
            return RetryableStorageError(f"{where}: {type(exc).__name__}: {exc}")
        if isinstance(exc, bx.NoCredentialsError | bx.PartialCredentialsError):
            return TerminalStorageError(f"{where}: no usable S3 credentials ({type(exc).__name__})")
        if isinstance(exc, bx.BotoCoreError):
            return TerminalStorageError(f"{where}: {type(exc).__name__}: {exc}")
        if isinstance(exc, OSError):  # local disk: no space, permission, file vanished
            return TerminalStorageError(f"{where}: local I/O error: {exc}")
        return None

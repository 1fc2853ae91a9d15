"""Checkpoint tier on any S3-compatible object store (AWS S3, SeaweedFS, MinIO, Ceph RGW, ...).

Library: **boto3** (with botocore and s3transfer). It is the de-facto standard S3 client, so every
S3-compatible server is tested against it; botocore brings retry modes with a retry quota and the
credential chain (env, profile, instance role, SSO); s3transfer brings a multipart transfer manager
with parallel parts (used for uploads). boto3 is the ``s3`` extra and is imported here lazily,
inside :class:`S3Store`, so ``import gpufleet`` in a training rank stays cheap.

Downloads do not go through s3transfer: ``download_dir`` splits every object into ranges (the
adaptive plan of :func:`plan_range_size`: about one range per worker, objects below 8 MiB whole,
no range above 64 MiB; or a fixed ``range_size``) and fetches all ranges of all objects at once
from one thread pool of ``max_concurrency`` over the one pooled client. Each range is a ``GET``
with ``Range`` and ``If-Match: <the listed ETag>`` (an object replaced mid-download fails with
412, never mixes two versions), read from the socket into a per-thread buffer (no allocation per
read) and written with ``os.pwrite`` into a file preallocated to its listed size, so ranges land
in place and no reassembly or temp file is needed. (boto3's own ``download_file`` funnels every
part through one writer thread; on loopback it is the slower of the two.)

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
import os
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

from gpufleet.core.errors import RetryableStorageError, StorageError, TerminalStorageError, UsageError

__all__ = ["S3Store", "StreamingUpload", "parse_s3_url", "plan_range_size", "MANIFEST_NAME"]

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
MiB = 1024 * 1024
_READ = 1 * MiB  # body read size of a download range (one pwrite each), per-thread buffer
RANGE_MIN = 8 * MiB  # adaptive download plan: objects up to this size are fetched in one GET
RANGE_MAX = 64 * MiB  # ... and no range is larger than this (one retry re-fetches at most this)
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


class _Cancelled(Exception):
    """Another range of the same download failed for good: stop early, quietly."""


@dataclass
class _Range:
    """``[start, end)`` of one object, written at the same offsets of an open file ``fd``."""

    job: _Job
    fd: int
    pos: int  # the next byte to fetch: a retry resumes here
    end: int


_CLIENTS: dict[tuple[Any, ...], Any] = {}
_CLIENTS_LOCK = threading.Lock()


def _shared_client(key: tuple[Any, ...] | None, make: Callable[[], Any]) -> Any:
    """A botocore client per (endpoint, credentials, settings), shared by every S3Store that asks.

    Creating one loads and parses botocore's service model: 0.05-0.15 CPU-s each time, paid by
    every store (one per upload URL, a fresh one per restore) before a single byte moves."""
    if key is None:
        return make()
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(key)
        if client is None:
            client = _CLIENTS[key] = make()
        return client


def plan_range_size(total: int, workers: int) -> int:
    """The adaptive download plan: one range per worker's share of ``total``, in whole MiB,
    at least :data:`RANGE_MIN` and at most :data:`RANGE_MAX`.

    So objects below the share (many small shards) are fetched whole, one GET each, in parallel
    across objects; a few large objects are split into about ``workers`` ranges in all. Finer
    ranges only add requests: on loopback with 4 x 64 MiB, 16 MiB ranges cost 30% more wall time
    than 32 MiB ones, and whole-object GETs cost about the same as 32 MiB ones."""
    share = -(-max(total, 1) // max(workers, 1))
    share = -(-share // MiB) * MiB
    return min(RANGE_MAX, max(RANGE_MIN, share))


def _body_reader(body: Any) -> Callable[[memoryview], int]:
    """``readinto`` for a GET's body: straight from the socket into ``view`` when possible.

    botocore's ``StreamingBody.read(n)`` allocates a new bytes object per call and copies it twice
    on the way up (http.client, then urllib3); reading ~250 MiB that way cost more client CPU than
    the transfer itself. The fast path reads into the caller's buffer from the plain (not chunked,
    not content-encoded) http.client response under urllib3, which does the exact-length accounting.
    Anything else falls back to ``body.read``. Socket errors surface as ``ConnectionError``
    (retryable), so they are never mistaken for local disk errors (terminal)."""
    raw = getattr(body, "_raw_stream", None)
    fp = getattr(raw, "_fp", None)
    plain = (
        fp is not None
        and not hasattr(body, "_checksum")  # a body botocore validates: leave it to botocore
        and hasattr(fp, "readinto")
        and not getattr(fp, "chunked", True)
        and getattr(raw, "_decoder", None) is None
        and not (getattr(raw, "headers", None) or {}).get("content-encoding")
        and getattr(raw, "_fp_bytes_read", 1) == 0
    )
    if not plain:

        def slow(view: memoryview) -> int:
            chunk = body.read(len(view))
            view[: len(chunk)] = chunk
            return len(chunk)

        return slow

    def fast(view: memoryview) -> int:
        try:
            return int(fp.readinto(view))
        except OSError as e:  # reset, timeout, ...: the network, not the disk
            raise ConnectionError(f"{type(e).__name__}: {e}") from e

    return fast


def _release(body: Any) -> None:
    """Hand a fully read body's connection back to the pool (or close a partly read one)."""
    raw = getattr(body, "_raw_stream", None)
    fp = getattr(raw, "_fp", None)
    if raw is not None and fp is not None and fp.isclosed() and hasattr(raw, "release_conn"):
        raw.release_conn()  # read to its end through the fast path: the connection is reusable
    body.close()  # a partly read body closes its connection: it cannot be reused


class S3Store:
    """Checkpoint directories under ``s3://bucket/prefix``: upload, list, read, download, delete."""

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
            endpoint_url
            or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL")
            or None
        )
        self.max_attempts = max_attempts
        self.backoff_base = backoff_base
        self.backoff_cap = backoff_cap
        self._sleep: Callable[[float], None] = time.sleep
        self._local = threading.local()  # per-thread read buffers of downloads
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
        self._client = _shared_client(
            shared,
            lambda: session.client("s3", endpoint_url=self.endpoint_url, region_name=region, config=config),
        )
        self._transfer_config = TransferConfig(
            multipart_threshold=multipart_threshold,
            multipart_chunksize=multipart_chunksize,
            max_concurrency=max_concurrency,
            use_threads=True,
            preferred_transfer_client="classic",
        )

    def __repr__(self) -> str:  # credentials live only inside the boto client; never shown
        return f"S3Store(url={self.url!r}, endpoint_url={self.endpoint_url!r})"

    # ----------------------------------------------------------------------------- public API
    def upload_dir(self, local_dir: Path, prefix: str, *, uploaded: Mapping[str, int] | None = None) -> int:
        """Upload every file under ``local_dir`` to ``<url>/<prefix>/``, ``manifest.json`` last.

        ``uploaded``: relative name -> size of files already in place under the prefix (a
        :class:`StreamingUpload` finished them); those of the same size locally are not sent again.
        The returned byte count includes them."""
        uploaded = dict(uploaded or {})
        local_dir = Path(local_dir)
        if not local_dir.is_dir():
            raise UsageError(f"not a directory: {local_dir}")
        base = self._key(_clean_rel(prefix, "prefix"))
        jobs: list[_Job] = []
        done: list[_Job] = []
        manifest: _Job | None = None
        for path in sorted(p for p in local_dir.rglob("*") if p.is_file()):
            rel = path.relative_to(local_dir).as_posix()
            job = _Job(f"{base}/{rel}", path, path.stat().st_size)
            if rel == MANIFEST_NAME:
                manifest = job
            elif uploaded.get(rel) == job.size:
                done.append(job)
            else:
                jobs.append(job)
        self._transfer(jobs, upload=True)
        if manifest is not None:
            self._transfer([manifest], upload=True)
            jobs.append(manifest)
        jobs += done
        total = sum(j.size for j in jobs)
        log.info("uploaded %d files, %d bytes to s3://%s/%s", len(jobs), total, self.bucket, base)
        return total

    def streaming_upload(self, prefix: str) -> StreamingUpload:
        """Start uploading files under ``<url>/<prefix>/`` while they are being written (see
        :class:`StreamingUpload`); finish with ``upload_dir(dir, prefix, uploaded=s.finish(dir))``."""
        return StreamingUpload(self, self._key(_clean_rel(prefix, "prefix")))

    def list_prefixes(self) -> list[str]:
        """Sub-prefixes directly under the URL (e.g. ``step_00000100``) that hold a manifest.json."""
        root = f"{self.prefix}/" if self.prefix else ""
        found = []
        for key, _size, _etag in self._call("list", root, lambda: list(self._list(root))):
            rest = key[len(root) :]
            name, _, tail = rest.partition("/")
            if name and tail == MANIFEST_NAME:
                found.append(name)
        return sorted(found)

    def read_json(self, key: str) -> dict[str, Any]:
        """Read and parse one JSON object; ``key`` is relative to the URL."""
        full = self._key(_clean_rel(key, "key"))

        def get() -> bytes:
            body = self._client.get_object(Bucket=self.bucket, Key=full)["Body"]
            try:
                return body.read()
            finally:
                body.close()

        data = self._call("get", full, get)
        try:
            doc = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise TerminalStorageError(f"s3://{self.bucket}/{full} is not valid JSON: {e}") from e
        if not isinstance(doc, dict):
            raise TerminalStorageError(f"s3://{self.bucket}/{full} is JSON but not an object")
        return doc

    def download_dir(self, prefix: str, local_dir: Path) -> int:
        """Download every object under ``prefix`` into ``local_dir`` (manifest last); return bytes.

        All ranges of all files are fetched in parallel (see the module notes); the manifest is
        fetched only after every other file is complete."""
        base = self._key(_clean_rel(prefix, "prefix"))
        local_dir = Path(local_dir)
        listing = self._call("list", base, lambda: list(self._list(base + "/")))
        if not listing:
            raise TerminalStorageError(f"nothing under s3://{self.bucket}/{base}/")
        jobs: list[_Job] = []
        manifest: _Job | None = None
        for key, size, etag in listing:
            rel = key[len(base) + 1 :]
            if not rel or rel.endswith("/"):
                continue  # a directory marker
            parts = PurePosixPath(rel).parts
            if any(p in (".", "..") for p in parts):
                raise TerminalStorageError(f"refusing unsafe key s3://{self.bucket}/{key}")
            job = _Job(key, local_dir.joinpath(*parts), size, etag)
            if rel == MANIFEST_NAME:
                manifest = job
            else:
                jobs.append(job)
        try:
            for job in [*jobs, *([manifest] if manifest else [])]:
                job.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise TerminalStorageError(f"cannot create {local_dir}: {e}") from e
        self._fetch(jobs)
        if manifest is not None:
            self._fetch([manifest])
            jobs.append(manifest)
        return sum(j.size for j in jobs)

    def delete_prefix(self, prefix: str) -> None:
        """Delete ``<url>/<prefix>/``: the manifest FIRST (the checkpoint vanishes), then the rest."""
        base = self._key(_clean_rel(prefix, "prefix"))
        manifest = f"{base}/{MANIFEST_NAME}"
        self._call("delete", manifest, lambda: self._client.delete_object(Bucket=self.bucket, Key=manifest))
        while True:
            keys = [k for k, _, _ in self._call("list", base, lambda: list(self._list(base + "/")))]
            if not keys:
                return
            for i in range(0, len(keys), 1000):
                batch = keys[i : i + 1000]
                self._call("delete", f"{base}/ ({len(batch)} objects)", lambda b=batch: self._delete_batch(b))

    # ----------------------------------------------------------------------------- internals
    def _key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def _list(self, prefix: str) -> Iterator[tuple[str, int, str]]:
        """(key, size, ETag) of every object under ``prefix``."""
        paginator = self._client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                yield obj["Key"], int(obj.get("Size", 0)), str(obj.get("ETag") or "")

    def _delete_batch(self, keys: list[str]) -> None:
        resp = self._client.delete_objects(
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

    def _call(self, op: str, what: str, fn: Callable[[], T]) -> T:
        """Run one whole-object operation with bounded backoff; classify what escapes."""
        last: StorageError | None = None
        for attempt in range(self.max_attempts):
            try:
                return fn()
            except Exception as e:  # noqa: BLE001 - classified right here; anything unknown re-raises
                err = self._classify(e, op, what)
                if err is None:
                    raise
                if isinstance(err, TerminalStorageError):
                    raise err from e
                last = err
            self._wait(attempt, op, what, last)
        raise RetryableStorageError(f"{last} (gave up after {self.max_attempts} attempts)") from last

    # -- multipart pieces, with the same retries (StreamingUpload's parts) ------------------------
    @property
    def part_size(self) -> int:
        """Bytes per multipart part (S3's 5 MiB minimum at least)."""
        return max(5 * MiB, self._transfer_config.multipart_chunksize)

    @property
    def concurrency(self) -> int:
        """Parallel requests one transfer may have in flight."""
        return max(1, self._transfer_config.max_request_concurrency)

    def create_multipart(self, key: str) -> str:
        """Open a multipart upload of ``key``; its id."""
        resp = self._call(
            "upload", key, lambda: self._client.create_multipart_upload(Bucket=self.bucket, Key=key)
        )
        return str(resp["UploadId"])

    def upload_part(self, key: str, upload_id: str, number: int, body: Any) -> str:
        """Send part ``number`` of an open multipart upload; its ETag."""
        resp = self._call(
            "upload",
            f"{key} part {number}",
            lambda: self._client.upload_part(
                Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=body
            ),
        )
        return str(resp["ETag"])

    def complete_multipart(self, key: str, upload_id: str, etags: list[tuple[int, str]]) -> None:
        """Complete a multipart upload from its parts' (number, ETag)."""
        parts = [{"PartNumber": n, "ETag": e} for n, e in etags]
        self._call(
            "upload",
            key,
            lambda: self._client.complete_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
            ),
        )

    def abort_multipart(self, key: str, upload_id: str) -> None:
        """Abort a multipart upload (one attempt: S3 lifecycle rules reap what this misses)."""
        self._client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)

    def _transfer(self, jobs: list[_Job], *, upload: bool) -> None:
        """Upload ``jobs`` in parallel (s3transfer); retry the failed ones in rounds with backoff."""
        from boto3.s3.transfer import create_transfer_manager

        if not upload:
            raise ValueError("downloads go through _fetch")
        op = "upload"
        pending = list(jobs)
        last: StorageError | None = None
        for attempt in range(self.max_attempts):
            if not pending:
                return
            failed: list[_Job] = []
            with create_transfer_manager(self._client, self._transfer_config) as tm:
                futures = []
                for job in pending:
                    futures.append((job, tm.upload(str(job.path), self.bucket, job.key)))
                for job, fut in futures:
                    try:
                        fut.result()
                    except Exception as e:  # noqa: BLE001 - classified right here; unknown re-raises
                        err = self._classify(e, op, job.key)
                        if err is None:
                            raise
                        if isinstance(err, TerminalStorageError):
                            raise err from e  # the manager's __exit__ cancels the rest
                        last = err
                        failed.append(job)
            pending = failed
            if pending:
                self._wait(attempt, op, f"{len(pending)} file(s), e.g. {pending[0].key}", last)
        if pending:
            raise RetryableStorageError(
                f"{op} of {len(pending)} file(s) failed after {self.max_attempts} attempts: {last}"
            ) from last

    def _fetch(self, jobs: list[_Job]) -> None:
        """Download ``jobs``: every range of every object in parallel, pwritten into place."""
        fds: list[int] = []
        ranges: list[_Range] = []
        step = self._range_size(jobs)
        try:
            for job in jobs:
                try:
                    fd = os.open(job.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
                    fds.append(fd)
                    os.ftruncate(fd, job.size)  # the final size at once: ranges land in place
                except OSError as e:
                    raise TerminalStorageError(f"s3 download to {job.path}: local I/O error: {e}") from e
                ranges += [_Range(job, fd, a, min(a + step, job.size)) for a in range(0, job.size, step)]
            if not ranges:
                return  # only empty objects: creating the files was the whole download
            stop = threading.Event()
            workers = min(self._transfer_config.max_request_concurrency, len(ranges))
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="s3get") as pool:
                futures = [pool.submit(self._get_range, r, stop) for r in ranges]
                try:
                    done, _ = wait(futures, return_when=FIRST_EXCEPTION)
                    failed = [f for f in futures if f in done and f.exception() is not None]
                    if failed:
                        raise failed[0].exception()  # type: ignore[misc]
                except BaseException:  # a range failed, or Ctrl-C: do not wait for the others
                    stop.set()  # running ranges stop at their next read; queued ones never start
                    for f in futures:
                        f.cancel()
                    raise
        finally:
            for fd in fds:
                os.close(fd)

    def _range_size(self, jobs: list[_Job]) -> int:
        """Bytes per ranged GET: ``range_size`` if set, else adaptive (see :func:`plan_range_size`)."""
        if self.range_size is not None:
            return self.range_size
        return plan_range_size(sum(j.size for j in jobs), self._transfer_config.max_request_concurrency)

    def _get_range(self, r: _Range, stop: threading.Event) -> None:
        """GET one range into place with bounded backoff; a retry resumes at the first missing byte."""
        last: StorageError | None = None
        for attempt in range(self.max_attempts):
            if stop.is_set():
                raise _Cancelled
            try:
                self._get_into(r, stop)
                return
            except _Cancelled:
                raise
            except Exception as e:  # noqa: BLE001 - classified right here; anything unknown re-raises
                err = self._classify(e, "download", f"{r.job.key} bytes {r.pos}-{r.end - 1}")
                if err is None:
                    raise
                if isinstance(err, TerminalStorageError):
                    raise err from e
                last = err
            self._wait(attempt, "download", f"{r.job.key} bytes {r.pos}-{r.end - 1}", last)
        raise RetryableStorageError(
            f"s3 download s3://{self.bucket}/{r.job.key}: bytes {r.pos}-{r.end - 1} still failing "
            f"after {self.max_attempts} attempts: {last}"
        ) from last

    def _get_into(self, r: _Range, stop: threading.Event) -> None:
        """One ranged GET of ``[r.pos, r.end)``, pwritten at the same offsets; ``r.pos`` advances."""
        want = f"bytes={r.pos}-{r.end - 1}"
        extra = {"IfMatch": r.job.etag} if r.job.etag else {}
        resp = self._client.get_object(Bucket=self.bucket, Key=r.job.key, Range=want, **extra)
        body = resp["Body"]
        try:
            if int(resp.get("ContentLength", -1)) != r.end - r.pos:
                raise TerminalStorageError(
                    f"s3 download s3://{self.bucket}/{r.job.key}: asked for {want}, the server sent "
                    f"{resp.get('ContentLength')} bytes ({resp.get('ContentRange')}): the object changed"
                )
            buf = self._buffer()
            read = _body_reader(body)
            while r.pos < r.end:
                if stop.is_set():
                    raise _Cancelled
                view = buf[: min(len(buf), r.end - r.pos)]
                got = read(view)
                if not got:  # the connection closed before Content-Length bytes came
                    raise ConnectionError(f"body ended at byte {r.pos} of {r.end}")
                view = view[:got]
                while view:
                    n = os.pwrite(r.fd, view, r.pos)
                    r.pos += n
                    view = view[n:]
        finally:
            _release(body)

    def _buffer(self) -> memoryview:
        """This thread's reusable read buffer: a range streams through it, no allocation per read."""
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = memoryview(bytearray(_READ))
        return buf

    def _wait(self, attempt: int, op: str, what: str, err: StorageError | None) -> None:
        if attempt + 1 >= self.max_attempts:
            return
        delay = self._backoff(attempt)
        log.warning(
            "s3 %s %s: %s; retry %d/%d in %.2fs", op, what, err, attempt + 1, self.max_attempts - 1, delay
        )
        self._sleep(delay)

    def _classify(self, exc: BaseException, op: str, what: str) -> StorageError | None:
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


class _PartBuffers:
    """Part buffers kept between checkpoints (per part size, at most ``cap`` of them): a fresh
    16 MiB ``bytearray`` is zero-filled and page-faulted in by the kernel on every save, which cost
    the streaming upload about a tenth of its client CPU; the next checkpoint reuses these."""

    def __init__(self, cap: int = 16) -> None:
        self.cap = cap
        self._lock = threading.Lock()
        self._free: dict[int, list[bytearray]] = {}

    def take(self, size: int) -> bytearray:
        with self._lock:
            free = self._free.get(size)
            if free:
                return free.pop()
        return bytearray(size)

    def give(self, bufs: list[bytearray]) -> None:
        with self._lock:
            for buf in bufs:
                free = self._free.setdefault(len(buf), [])
                if len(free) < self.cap:
                    free.append(buf)


_PART_BUFFERS = _PartBuffers()


class StreamingUpload:
    """Multipart uploads fed with each file's bytes as a writer produces them (the engine's
    pipelined upload: the S3 copy grows while the local checkpoint is still being written).

    :meth:`stream` gives one sink per file; its ``write`` copies bytes into a part buffer and hands
    each full part (``multipart_chunksize``) to a pool of ``max_concurrency`` upload threads. Sinks
    never raise into the writer, never touch the network on its thread and never make it wait:
    when every upload slot is busy (S3 slower than the disk), a sink stops buffering and remembers
    where it stopped. After the local commit, :meth:`finish` sends the rest of such files from the
    local copy into the same multipart uploads, sends every last part, completes the uploads and
    returns ``{name: size}`` of the files now in S3 (a file below one part is left to a plain
    PUT: a multipart upload would cost two more requests). A file whose stream failed (a part out of
    retries) is aborted and left out; ``S3Store.upload_dir(uploaded=...)`` then sends it whole, and
    the manifest last, so a torn stream is never visible as a checkpoint.
    Memory: one part buffer per open file plus at most ``max_concurrency`` parts in flight; the
    buffers stay in a process-wide pool for the next checkpoint (:class:`_PartBuffers`)."""

    def __init__(self, store: S3Store, base: str) -> None:
        self.store = store
        self._base = base
        self._part = store.part_size
        workers = store.concurrency
        self.slots = threading.BoundedSemaphore(workers)  # upload slots: a part in flight holds one
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="s3put")
        self._sinks: dict[str, _PartSink] = {}
        self._lock = threading.Lock()
        self._free: list[bytearray] = []  # part buffers back from the pool, reused

    def take_buffer(self) -> bytearray:
        """A part buffer (a recycled one when there is one)."""
        with self._lock:
            if self._free:
                return self._free.pop()
        return _PART_BUFFERS.take(self._part)

    def recycle(self, buf: bytearray | None) -> None:
        """Give a part buffer back for reuse."""
        if buf is not None and len(buf) == self._part:
            with self._lock:
                self._free.append(buf)

    def stream(self, name: str) -> _PartSink:
        """The sink for file ``name`` (relative to the prefix), fed in file order."""
        sink = _PartSink(self, name, f"{self._base}/{_clean_rel(name, 'file name')}")
        with self._lock:
            self._sinks[name] = sink
        return sink

    def finish(self, local_dir: Path) -> dict[str, int]:
        """Send what the streams left (from the files in ``local_dir``), complete every healthy
        upload; ``{name: size}`` of the files now in S3."""
        done: dict[str, int] = {}
        try:
            sinks = list(self._sinks.values())
            for sink in sinks:  # queue every file's remaining parts first: they upload in parallel
                sink.send_rest(Path(local_dir) / sink.name)
            for sink in sinks:
                if sink.complete():
                    done[sink.name] = sink.size
        finally:
            self.pool.shutdown(wait=True)
            self._release_buffers()
        return done

    def _release_buffers(self) -> None:
        with self._lock:
            free, self._free = self._free, []
        _PART_BUFFERS.give(free)

    def abort(self) -> None:
        """Drop everything (the local save failed): abort the open multipart uploads."""
        try:
            for sink in list(self._sinks.values()):
                sink.fail(RuntimeError("the local save failed"))
                sink.complete()
        finally:
            self.pool.shutdown(wait=True)
            self._release_buffers()


def _read_full(f: Any, view: memoryview) -> int:
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            break
        got += n
    return got


class _PartSink:
    """One file's multipart upload inside a :class:`StreamingUpload`."""

    def __init__(self, owner: StreamingUpload, name: str, key: str) -> None:
        self._owner = owner
        self.name = name
        self.key = key
        self.size = 0  # bytes the writer produced
        self._buf: bytearray | None = owner.take_buffer()
        self._fill = 0
        self._sent = 0  # bytes handed to upload threads: the local file's rest starts here
        self._tail = False  # no free slot once: the rest comes from the local file after the commit
        self._upload_id: str | None = None
        self._upload_lock = threading.Lock()
        self._parts: list[tuple[int, Any]] = []  # (part number, future of its ETag)
        self.error: BaseException | None = None

    def fail(self, err: BaseException) -> None:
        """Drop this file from the stream (any thread: the buffer stays with the writer's thread)."""
        if self.error is None:
            self.error = err

    def write(self, data: Any) -> None:
        """Append bytes (any buffer). Never raises, never blocks on the network."""
        try:
            view = memoryview(data).cast("B")
            self.size += view.nbytes
            while view and self._buf is not None and not self._tail and self.error is None:
                k = min(view.nbytes, len(self._buf) - self._fill)
                self._buf[self._fill : self._fill + k] = view[:k]
                self._fill += k
                view = view[k:]
                if self._fill == len(self._buf):
                    if self._submit(self._buf, self._fill, block=False):
                        self._buf, self._fill = self._owner.take_buffer(), 0
                    else:  # every slot busy: keep the writer going, send the rest from the file
                        self._tail = True
                        self._owner.recycle(self._buf)
                        self._buf, self._fill = None, 0
        except BaseException as e:  # noqa: BLE001 - the local write must go on; the file is re-sent later
            self.fail(e)

    def _submit(self, buf: bytearray, used: int, *, block: bool) -> bool:
        if not self._owner.slots.acquire(blocking=block):
            return False
        number = len(self._parts) + 1
        try:
            self._parts.append((number, self._owner.pool.submit(self._put, number, buf, used)))
        except BaseException:
            self._owner.slots.release()
            raise
        self._sent += used
        return True

    def _ensure_upload(self) -> str:
        """The multipart upload's id, created by the first part (on an upload thread)."""
        with self._upload_lock:
            if self._upload_id is None:
                self._upload_id = self._owner.store.create_multipart(self.key)
            return self._upload_id

    def _put(self, number: int, buf: bytearray, used: int) -> str:
        body = buf if used == len(buf) else memoryview(buf)[:used].tobytes()
        try:
            if self.error is not None:
                raise RuntimeError("stream dropped")
            upload_id = self._ensure_upload()
            return self._owner.store.upload_part(self.key, upload_id, number, body)
        except BaseException as e:
            self.fail(e)
            raise
        finally:
            self._owner.recycle(buf)
            self._owner.slots.release()

    def send_rest(self, path: Path) -> None:
        """After the commit: queue the parts the stream did not send (the last one, or the tail
        of the file read back from ``path``). Blocks for upload slots; never raises."""
        if self.error is not None or self.size == 0:
            return
        if not self._parts and not self._tail:  # below one part: one plain PUT by upload_dir is cheaper
            self._owner.recycle(self._buf)
            self.size, self._buf = 0, None
            return
        try:
            if not self._tail:
                if self._fill and self._buf is not None:
                    self._submit(self._buf, self._fill, block=True)
                    self._buf, self._fill = None, 0
                return
            with open(path, "rb") as f:
                f.seek(self._sent)
                while self.error is None:
                    buf = self._owner.take_buffer()
                    n = _read_full(f, memoryview(buf))
                    if not n:
                        self._owner.recycle(buf)
                        return
                    self._submit(buf, n, block=True)
                    if n < len(buf):
                        return
        except BaseException as e:  # noqa: BLE001 - reported by complete(); the file goes the ordinary way
            self.fail(e)

    def complete(self) -> bool:
        """Wait for every part, complete the upload; False (and aborted) on any failure."""
        store = self._owner.store
        if self.error is None and self.size == 0:
            return False  # empty or below one part: nothing opened, the ordinary upload sends it
        try:
            etags = [(n, f.result()) for n, f in self._parts]
            if self.error is not None:
                raise self.error
            if self._sent != self.size or self._upload_id is None:
                raise RuntimeError(f"sent {self._sent} of {self.size} bytes")
            store.complete_multipart(self.key, self._upload_id, etags)
            return True
        except BaseException as e:  # noqa: BLE001 - logged; the file goes the ordinary way
            self.fail(e)
            self._buf = None
            log.warning("s3 streaming upload of %s dropped (sent whole after the commit): %s", self.key, e)
            for _, f in self._parts:
                f.exception()  # wait: no part may land after the abort
            if self._upload_id is not None:
                try:
                    store.abort_multipart(self.key, self._upload_id)
                except Exception as err:  # noqa: BLE001 - best effort; S3 lifecycle rules reap the rest
                    log.warning("s3 abort of %s failed: %s", self.key, err)
            return False

"""Uploads to S3: whole committed directories, and multipart streams fed while files are written.

``upload_dir`` sends every file through s3transfer (parallel multipart parts), retrying the failed
files in rounds with the store's backoff, and sends ``manifest.json`` only after every other file
has landed, so a half-uploaded checkpoint is never visible. :class:`StreamingUpload` is the
engine's pipelined upload: the S3 copy grows while the local checkpoint is still being written.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpufleet.checkpoint.storage.s3.client import MANIFEST_NAME, _clean_rel, _Job
from gpufleet.core.errors import RetryableStorageError, StorageError, TerminalStorageError, UsageError

if TYPE_CHECKING:
    from gpufleet.checkpoint.storage.s3.client import S3Client

__all__ = ["StreamingUpload", "streaming_upload", "upload_dir"]

log = logging.getLogger(__name__)


def upload_dir(
    store: S3Client, local_dir: Path, prefix: str, *, uploaded: Mapping[str, int] | None = None
) -> int:
    """Upload every file under ``local_dir`` to ``<url>/<prefix>/``, ``manifest.json`` last.

    ``uploaded``: relative name -> size of files already in place under the prefix (a
    :class:`StreamingUpload` finished them); those of the same size locally are not sent again.
    The returned byte count includes them."""
    uploaded = dict(uploaded or {})
    local_dir = Path(local_dir)
    if not local_dir.is_dir():
        raise UsageError(f"not a directory: {local_dir}")
    base = store.key_for(_clean_rel(prefix, "prefix"))
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
    _send(store, jobs)
    if manifest is not None:
        _send(store, [manifest])
        jobs.append(manifest)
    jobs += done
    total = sum(j.size for j in jobs)
    log.info("uploaded %d files, %d bytes to s3://%s/%s", len(jobs), total, store.bucket, base)
    return total


def streaming_upload(store: S3Client, prefix: str) -> StreamingUpload:
    """Start uploading files under ``<url>/<prefix>/`` while they are being written (see
    :class:`StreamingUpload`); finish with ``upload_dir(store, dir, prefix, uploaded=s.finish(dir))``."""
    return StreamingUpload(store, store.key_for(_clean_rel(prefix, "prefix")))


def _send(store: S3Client, jobs: list[_Job]) -> None:
    """Upload ``jobs`` in parallel (s3transfer); retry the failed ones in rounds with backoff."""
    from boto3.s3.transfer import create_transfer_manager

    op = "upload"
    pending = list(jobs)
    last: StorageError | None = None
    for attempt in range(store.max_attempts):
        if not pending:
            return
        failed: list[_Job] = []
        with create_transfer_manager(store.client, store.transfer_config) as tm:
            futures = []
            for job in pending:
                futures.append((job, tm.upload(str(job.path), store.bucket, job.key)))
            for job, fut in futures:
                try:
                    fut.result()
                except Exception as e:  # noqa: BLE001 - classified right here; unknown re-raises
                    err = store.classify(e, op, job.key)
                    if err is None:
                        raise
                    if isinstance(err, TerminalStorageError):
                        raise err from e  # the manager's __exit__ cancels the rest
                    last = err
                    failed.append(job)
        pending = failed
        if pending:
            store.wait_to_retry(attempt, op, f"{len(pending)} file(s), e.g. {pending[0].key}", last)
    if pending:
        raise RetryableStorageError(
            f"{op} of {len(pending)} file(s) failed after {store.max_attempts} attempts: {last}"
        ) from last


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
    retries) is aborted and left out; ``upload_dir(uploaded=...)`` then sends it whole, and
    the manifest last, so a torn stream is never visible as a checkpoint.
    Memory: one part buffer per open file plus at most ``max_concurrency`` parts in flight; the
    buffers stay in a process-wide pool for the next checkpoint (:class:`_PartBuffers`)."""

    def __init__(self, store: S3Client, base: str) -> None:
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

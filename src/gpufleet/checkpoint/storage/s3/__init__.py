"""The S3 tier, as the engine and restore see it: committed checkpoints by step, under ``upload_url``.

Layout mirrors the local one: ``<upload_url>/step_00000123/...`` with ``manifest.json`` uploaded
last, so a remote prefix without a manifest is as invisible as a local directory without one.

:class:`S3Store` is one ``s3://bucket/prefix``: the :class:`~.client.S3Client` (the pooled boto3
client, loaded on first use: boto3 is the ``s3`` extra; its retries and error classes) with the
directory transfers of :mod:`.download` (ranged parallel GETs) and :mod:`.upload` (whole directories
and streaming multipart parts). The functions below take the
:class:`~gpufleet.checkpoint.config.CheckpointConfig` and work through one cached store per URL.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping
from functools import lru_cache
from pathlib import Path

from gpufleet.checkpoint.config import CheckpointConfig, CheckpointInfo
from gpufleet.checkpoint.manifest import MANIFEST_NAME, Manifest, parse_step, step_dirname
from gpufleet.checkpoint.storage.s3 import download, upload
from gpufleet.checkpoint.storage.s3.client import S3Client
from gpufleet.checkpoint.storage.s3.upload import StreamingUpload
from gpufleet.core import events as E
from gpufleet.core.errors import StorageError

__all__ = [
    "S3Store",
    "stream_upload",
    "upload_commit",
    "download_commit",
    "list_steps",
    "list_infos",
    "retain",
    "url_for",
    "CACHE_DIR",
]

CACHE_DIR = ".s3cache"  # downloads land here, never over a local checkpoint


class S3Store(S3Client):
    """Checkpoint directories under ``s3://bucket/prefix``: upload, list, read, download, delete."""

    def upload_dir(self, local_dir: Path, prefix: str, *, uploaded: Mapping[str, int] | None = None) -> int:
        """Upload every file under ``local_dir`` to ``<url>/<prefix>/``, ``manifest.json`` last
        (:func:`.upload.upload_dir`); the bytes now in place."""
        return upload.upload_dir(self, local_dir, prefix, uploaded=uploaded)

    def streaming_upload(self, prefix: str) -> StreamingUpload:
        """Start uploading files under ``<url>/<prefix>/`` while they are being written (see
        :class:`StreamingUpload`); finish with ``upload_dir(dir, prefix, uploaded=s.finish(dir))``."""
        return upload.streaming_upload(self, prefix)

    def download_dir(self, prefix: str, local_dir: Path) -> int:
        """Download every object under ``prefix`` into ``local_dir``, manifest last
        (:func:`.download.download_dir`); the bytes downloaded."""
        return download.download_dir(self, prefix, local_dir)


@lru_cache(maxsize=8)
def _store(url: str, endpoint: str | None) -> S3Store:
    return S3Store(url, endpoint_url=endpoint)


def store(config: CheckpointConfig) -> S3Store:
    assert config.upload_url is not None
    return _store(config.upload_url, config.s3_endpoint)


def url_for(config: CheckpointConfig, name: str) -> str:
    return f"{(config.upload_url or '').rstrip('/')}/{name}"


def stream_upload(config: CheckpointConfig, name: str) -> StreamingUpload:
    """Start the S3 copy of checkpoint ``name`` while its files are written (:class:`StreamingUpload`):
    the engine's writer feeds it every shard's bytes; :func:`upload_commit` finishes it after the commit."""
    return store(config).streaming_upload(name)


def upload_commit(config: CheckpointConfig, ckpt_dir: Path, stream: StreamingUpload | None = None) -> int:
    """Upload one committed checkpoint directory (the store puts manifest.json last).

    With ``stream`` (from :func:`stream_upload`), the files it already completed are not sent
    again: only the rest (``.metadata``, any file the stream dropped), then the manifest."""
    uploaded = stream.finish(ckpt_dir) if stream is not None else None
    return int(store(config).upload_dir(ckpt_dir, ckpt_dir.name, uploaded=uploaded))


def list_steps(config: CheckpointConfig) -> dict[int, str]:
    """{step: prefix} of remote checkpoints that have a manifest."""
    out: dict[int, str] = {}
    for prefix in store(config).list_prefixes():
        step = parse_step(prefix.rstrip("/").rsplit("/", 1)[-1])
        if step is not None:
            out[step] = prefix
    return out


def list_infos(config: CheckpointConfig) -> list[CheckpointInfo]:
    out = []
    s = store(config)
    for step, prefix in sorted(list_steps(config).items(), reverse=True):
        try:
            m = Manifest.from_json(s.read_json(f"{prefix.rstrip('/')}/{MANIFEST_NAME}"))
        except (ValueError, StorageError):
            continue  # unreadable remote manifest: that checkpoint does not exist
        out.append(CheckpointInfo(step, url_for(config, step_dirname(step)), m.time, m.total_bytes, "s3"))
    return out


def download_commit(config: CheckpointConfig, prefix: str, root: Path) -> Path:
    """Download a remote checkpoint into ``root/.s3cache/step_N`` (replacing an older download)."""
    name = prefix.rstrip("/").rsplit("/", 1)[-1]
    cache = root / CACHE_DIR
    if cache.exists():
        shutil.rmtree(cache)
    dest = cache / name
    dest.mkdir(parents=True)
    store(config).download_dir(prefix, dest)
    return dest


def retain(config: CheckpointConfig, doomed: list[int], emit: Callable[[E.Event], None]) -> None:
    """Delete remote copies of the checkpoints retention dropped locally."""
    if not doomed:
        return
    remote = list_steps(config)
    for step in doomed:
        if step in remote:
            store(config).delete_prefix(remote[step])
            emit(E.CkptDeleted(step=step, path=url_for(config, step_dirname(step)), reason="retention"))

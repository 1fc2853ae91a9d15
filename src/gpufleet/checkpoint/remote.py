"""The engine's S3 tier, on top of :class:`gpufleet.checkpoint.s3.S3Store` (imported lazily: boto3).

Layout mirrors the local one: ``<upload_url>/step_00000123/...`` with ``manifest.json`` uploaded
last, so a remote prefix without a manifest is as invisible as a local directory without one.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

from gpufleet.checkpoint.config import CheckpointConfig, CheckpointInfo
from gpufleet.checkpoint.manifest import MANIFEST_NAME, Manifest, parse_step, step_dirname
from gpufleet.core import events as E
from gpufleet.core.errors import StorageError

__all__ = [
    "stream_upload",
    "upload",
    "download",
    "list_steps",
    "list_infos",
    "retain",
    "url_for",
    "CACHE_DIR",
]

CACHE_DIR = ".s3cache"  # downloads land here, never over a local checkpoint


@lru_cache(maxsize=8)
def _store(url: str, endpoint: str | None) -> Any:
    from gpufleet.checkpoint.s3 import S3Store

    return S3Store(url, endpoint_url=endpoint)


def store(config: CheckpointConfig) -> Any:
    assert config.upload_url is not None
    return _store(config.upload_url, config.s3_endpoint)


def url_for(config: CheckpointConfig, name: str) -> str:
    return f"{(config.upload_url or '').rstrip('/')}/{name}"


def stream_upload(config: CheckpointConfig, name: str) -> Any:
    """Start the S3 copy of checkpoint ``name`` while its files are written (S3Store.StreamingUpload):
    the engine's writer feeds it every shard's bytes; :func:`upload` finishes it after the commit."""
    return store(config).streaming_upload(name)


def upload(config: CheckpointConfig, ckpt_dir: Path, stream: Any = None) -> int:
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


def download(config: CheckpointConfig, prefix: str, root: Path) -> Path:
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

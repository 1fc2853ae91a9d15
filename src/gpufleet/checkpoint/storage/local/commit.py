"""Publishing and removing a checkpoint directory: the manifest is written last and deleted first.

A save writes into ``step_N.tmp``; :func:`commit` renames it to ``step_N`` (still invisible: no
manifest) and then writes ``manifest.json``, the commit point. :func:`delete` removes the manifest
before the files, and :func:`sweep` clears what a kill between those steps left behind, so a
reader (restore, ``gpufleet ckpt``) only ever sees whole checkpoints.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

from gpufleet.checkpoint.manifest import (
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    fsync_dir,
    list_committed,
    parse_step,
    write_manifest,
)
from gpufleet.checkpoint.verify import hash_file

__all__ = ["commit", "delete", "sweep"]


def commit(
    tmp: Path,
    final: Path,
    *,
    step: int,
    world_size: int,
    meta: dict[str, Any],
    file_sums: dict[str, tuple[int, str]],
) -> dict[str, FileEntry]:
    """Publish the written directory ``tmp`` as ``final``; returns the manifest's file entries.

    ``file_sums``: the writer's (size, xxh3) per shard file; DCP's own ``.metadata`` is hashed here."""
    files = {name: FileEntry(size, digest) for name, (size, digest) in file_sums.items()}
    size, digest = hash_file(tmp / ".metadata")  # small; written by DCP itself
    files[".metadata"] = FileEntry(size, digest)
    fsync_dir(tmp)
    old = None
    if final.exists():  # re-saving a step (after a rollback): park the old one until we commit
        old = final.with_name(final.name + f".old-{os.getpid()}")
        os.rename(final, old)
    os.rename(tmp, final)  # still invisible: no manifest yet
    fsync_dir(final.parent)
    manifest = Manifest(step=step, time=time.time(), world_size=world_size, files=files, meta=meta)
    write_manifest(final, manifest)  # the commit point
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return files


def delete(path: Path) -> None:
    """Remove a committed checkpoint. Manifest first: a crash mid-delete leaves an invisible
    directory, never a half one."""
    (path / MANIFEST_NAME).unlink(missing_ok=True)
    shutil.rmtree(path, ignore_errors=True)


def sweep(root: Path, newest: int) -> None:
    """Remove step dirs older than the newest commit that have no valid manifest: a kill between
    rename and manifest, or an interrupted deletion. They are invisible to restore already."""
    valid = {p.name for p, _ in list_committed(root)}
    for p in root.iterdir():
        step = parse_step(p.name)
        if step is not None and step < newest and p.name not in valid and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)

"""The manifest: the commit point of a checkpoint directory (no torch import).

Layout: ``<dir>/step_00000123/`` holds DCP's files plus ``manifest.json``. The manifest is written
last, through write-tmp + fsync + rename + fsync(dir). A directory without a valid manifest does not
exist for restore, so there is no mutable "latest" pointer to get wrong: the newest checkpoint is
the highest step whose manifest parses.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "MANIFEST_NAME",
    "FORMAT",
    "Manifest",
    "FileEntry",
    "step_dirname",
    "parse_step",
    "read_manifest",
    "write_manifest",
    "list_committed",
    "fsync_dir",
]

MANIFEST_NAME = "manifest.json"
FORMAT = "gpufleet-ckpt/1"
_STEP_RE = re.compile(r"^step_(\d{8,})$")


def step_dirname(step: int) -> str:
    return f"step_{step:08d}"


def parse_step(name: str) -> int | None:
    """Step of a committed-checkpoint directory name, or None for anything else (temp dirs too)."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


@dataclass
class FileEntry:
    bytes: int
    xxh3: str  # xxh3_64 as 16 hex digits


@dataclass
class Manifest:
    step: int
    time: float
    world_size: int
    files: dict[str, FileEntry]
    meta: dict[str, Any] = field(default_factory=dict)
    format: str = FORMAT

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "step": self.step,
            "time": self.time,
            "world_size": self.world_size,
            "total_bytes": self.total_bytes,
            "meta": self.meta,
            "files": {k: {"bytes": v.bytes, "xxh3": v.xxh3} for k, v in sorted(self.files.items())},
        }

    @classmethod
    def from_json(cls, d: Any) -> Manifest:
        """Parse and validate; raises ValueError on anything malformed."""
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError("not a gpufleet manifest")
        files = d.get("files")
        if not isinstance(files, dict) or not files:
            raise ValueError("manifest has no file list")
        entries: dict[str, FileEntry] = {}
        for name, e in files.items():
            if (
                not isinstance(name, str)
                or "/" in name
                or name in ("", ".", "..")
                or not isinstance(e, dict)
                or not isinstance(e.get("bytes"), int)
                or not isinstance(e.get("xxh3"), str)
            ):
                raise ValueError(f"bad file entry {name!r}")
            entries[name] = FileEntry(e["bytes"], e["xxh3"])
        step, wall, ws = d.get("step"), d.get("time"), d.get("world_size")
        if not isinstance(step, int) or not isinstance(wall, int | float) or not isinstance(ws, int):
            raise ValueError("manifest lacks step/time/world_size")
        meta = d.get("meta") or {}
        if not isinstance(meta, dict):
            raise ValueError("manifest meta is not an object")
        return cls(step=step, time=float(wall), world_size=ws, files=entries, meta=meta)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a rename/creation inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(ckpt_dir: str | os.PathLike[str], manifest: Manifest) -> Path:
    """Write ``manifest.json`` atomically: tmp file, fsync, rename, fsync(dir). This is the commit."""
    d = Path(ckpt_dir)
    tmp = d / f".{MANIFEST_NAME}.tmp"
    data = (json.dumps(manifest.to_json(), indent=1, default=str) + "\n").encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    final = d / MANIFEST_NAME
    os.replace(tmp, final)
    fsync_dir(d)
    return final


def read_manifest(ckpt_dir: str | os.PathLike[str]) -> Manifest:
    """Read and validate a checkpoint's manifest; raises ValueError/OSError when absent or invalid."""
    raw = (Path(ckpt_dir) / MANIFEST_NAME).read_bytes()
    try:
        d = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"manifest is not valid JSON ({e.msg})") from None
    m = Manifest.from_json(d)
    expect = parse_step(Path(ckpt_dir).name)
    if expect is not None and expect != m.step:
        raise ValueError(f"manifest step {m.step} does not match directory {Path(ckpt_dir).name}")
    return m


def list_committed(root: str | os.PathLike[str]) -> list[tuple[Path, Manifest]]:
    """Committed checkpoints under ``root`` (valid manifest), newest step first."""
    r = Path(root)
    if not r.is_dir():
        return []
    out: list[tuple[Path, Manifest]] = []
    for p in r.iterdir():
        if parse_step(p.name) is None or not p.is_dir():
            continue
        try:
            out.append((p, read_manifest(p)))
        except (OSError, ValueError):
            continue  # torn, missing or foreign manifest: the directory does not exist for restore
    out.sort(key=lambda pm: pm[1].step, reverse=True)
    return out

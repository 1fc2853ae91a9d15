"""Input and output paths, checked before any work starts, with errors that name the path.

Commands call :func:`output_dir` and :func:`output_file` on every path they will write before they
start, so a bad one fails with one line and leaves nothing behind; inputs are read through
:func:`read_text` and :func:`read_json`, which turn an ``OSError``, a decode error or malformed JSON into
an :class:`~gpufleet.core.errors.InputError` naming the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from gpufleet.core.errors import InputError, OutputPathError

__all__ = ["output_dir", "output_file", "input_dir", "input_file", "read_text", "read_json"]


def _label(path: Path, flag: str | None) -> Path | str:
    return f"{flag} {path}" if flag else path


def _probe_dirs(path: Path, flag: str | None) -> None:
    """Make ``path`` and its missing parents, then remove what was made: proof that the command can
    make them later (``/proc/x``, a read-only mount or a file on the way all fail here)."""
    made: list[Path] = []
    missing = [p for p in (path, *path.parents) if not p.exists()]
    try:
        for p in reversed(missing):
            p.mkdir()
            made.append(p)
        probe = path / f".gpufleet-probe-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as e:
        blocker = Path(e.filename) if e.filename else path
        reason = e.strerror or str(e)
        if blocker != path:
            reason = f"cannot create it ({blocker}: {reason})"
        raise OutputPathError(_label(path, flag), reason) from None
    finally:
        for p in reversed(made):
            p.rmdir()


def output_dir(path: str | os.PathLike[str], flag: str | None = None) -> Path:
    """``path`` as a directory the command may write into: an existing writable directory, or one that
    can be made. Nothing is left on disk. ``flag`` names the option in the error."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise OutputPathError(_label(p, flag), "exists and is not a directory")
    _probe_dirs(p, flag)
    return p


def output_file(path: str | os.PathLike[str], flag: str | None = None) -> Path:
    """``path`` as a file the command may write: not a directory, in a directory that exists or can be
    made and is writable. Nothing is left on disk."""
    p = Path(path)
    if p.is_dir():
        raise OutputPathError(_label(p, flag), "is a directory; expected a file name")
    if p.exists() and not os.access(p, os.W_OK):
        raise OutputPathError(_label(p, flag), "not writable")
    parent = p.parent
    if parent.exists() and not parent.is_dir():
        raise OutputPathError(_label(p, flag), f"{parent} is not a directory")
    _probe_dirs(parent, flag)
    return p


def input_dir(path: str | os.PathLike[str], flag: str | None = None) -> Path:
    """``path`` as an existing directory to read."""
    p = Path(path)
    if not p.exists():
        raise InputError(_label(p, flag), "no such directory")
    if not p.is_dir():
        raise InputError(_label(p, flag), "not a directory")
    return p


def input_file(path: str | os.PathLike[str], flag: str | None = None) -> Path:
    """``path`` as an existing file to read."""
    p = Path(path)
    if not p.exists():
        raise InputError(_label(p, flag), "no such file")
    if p.is_dir():
        raise InputError(_label(p, flag), "is a directory; expected a file")
    return p


def read_text(path: str | os.PathLike[str], what: str = "file") -> str:
    """The UTF-8 text of ``path``; InputError (naming it and ``what`` it is) if it cannot be read."""
    p = Path(path)
    try:
        return p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(p, f"no such {what}") from None
    except IsADirectoryError:
        raise InputError(p, f"is a directory; expected a {what}") from None
    except UnicodeDecodeError as e:
        raise InputError(p, f"{what} is not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise InputError(p, f"cannot read {what}: {e.strerror or e}") from None


def read_json(path: str | os.PathLike[str], what: str = "JSON file") -> Any:
    """The parsed JSON of ``path``; InputError naming it if it cannot be read or is not valid JSON."""
    text = read_text(path, what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(Path(path), f"{what} is not valid JSON ({e.msg} at line {e.lineno})") from None

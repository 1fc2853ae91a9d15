"""Offline text corpora: the domain (Python standard library source) and general English (GNU info
manuals, with ``pydoc_data/topics.py`` as a fallback), split by file into train and held-out parts.

A corpus spec is a built-in name (``python-stdlib``, ``gnu-info``) or a path: a text file or a
directory (every file under it, recursively, that decodes as UTF-8). Splits are by file and
deterministic (a hash of the relative path), so no held-out file ever feeds calibration or healing.
"""

from __future__ import annotations

import gzip
import hashlib
import shutil
import subprocess
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from gpufleet.core.errors import UsageError

__all__ = ["Split", "texts", "tokens", "chunks", "BUILTIN", "HELDOUT_EVERY"]

Split = Literal["train", "heldout", "all"]
BUILTIN = ("python-stdlib", "gnu-info")
HELDOUT_EVERY = 8  # one file in 8 is held out
_MAX_FILE_BYTES = 400_000


def _split_of(rel: str) -> str:
    h = int(hashlib.sha1(rel.encode()).hexdigest()[:8], 16)
    return "heldout" if h % HELDOUT_EVERY == 0 else "train"


def _stdlib_files() -> list[tuple[str, Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = str(p.relative_to(root))
        top = rel.split("/", 1)[0]
        if top in ("site-packages", "dist-packages", "pydoc_data", "test", "idlelib") or "/test" in rel:
            continue
        out.append((rel, p))
    return out


def _info_files() -> list[tuple[str, Path]]:
    roots: set[Path] = set()
    if shutil.which("info"):
        try:
            w = subprocess.run(["info", "-w", "coreutils"], capture_output=True, text=True, timeout=10)
            if w.returncode == 0 and w.stdout.strip() and Path(w.stdout.strip()).exists():
                roots.add(Path(w.stdout.strip()).parent)
        except (OSError, subprocess.SubprocessError):
            pass
    roots.add(Path("/usr/share/info"))
    out = []
    for root in sorted(roots):
        if root.is_dir():
            for p in sorted(root.iterdir()):
                if p.is_file() and (p.name.endswith((".info", ".info.gz")) or ".info-" in p.name):
                    out.append((p.name, p))
    if not out:  # no GNU manuals installed: the English help topics of the stdlib's pydoc
        topics = Path(sysconfig.get_paths()["stdlib"]) / "pydoc_data" / "topics.py"
        if topics.is_file():
            out.append(("topics.py", topics))
    return out


def _path_files(spec: str) -> list[tuple[str, Path]]:
    p = Path(spec)
    if not p.exists():
        raise UsageError(f"corpus not found: {spec} (a path, or one of: {', '.join(BUILTIN)})")
    if p.is_file():
        return [(p.name, p)]
    return [(str(f.relative_to(p)), f) for f in sorted(p.rglob("*")) if f.is_file()]


def _read(path: Path) -> str:
    try:
        raw = path.read_bytes()
        if path.suffix == ".gz":
            raw = gzip.decompress(raw)
        text = raw[:_MAX_FILE_BYTES].decode("utf-8")
    except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
        return ""
    if path.name == "topics.py" and path.parent.name == "pydoc_data":  # keep the prose, not the dict syntax
        text = text.replace("\\n", "\n").replace("\\'", "'")
    return text


def files(spec: str) -> list[tuple[str, Path]]:
    """(relative name, path) of every file of the corpus ``spec``."""
    if spec == "python-stdlib":
        return _stdlib_files()
    if spec == "gnu-info":
        return _info_files()
    return _path_files(spec)


def texts(spec: str, split: Split = "all") -> Iterator[str]:
    """The non-empty texts of ``spec``'s files in ``split``, in a fixed order."""
    for rel, path in files(spec):
        if split != "all" and _split_of(rel) != split:
            continue
        t = _read(path)
        if t.strip():
            yield t


def tokens(tokenizer: Any, spec: str, split: Split, n_tokens: int, *, per_file: int = 0) -> list[int]:
    """The first ``n_tokens`` token ids of ``spec``'s ``split`` (files joined by the EOS token).

    ``per_file`` > 0: at most that many tokens of each file per pass, the files in a fixed order
    mixed by their names' hashes, passes repeated until ``n_tokens``: a pool that spans the corpus.
    (The default reads the files in sorted order, whole: for the standard library's train split the
    first 171 k tokens are 25 modules, ``_pydecimal`` a third of them.)

    Raises UsageError when the corpus holds no text at all (one line, exit 2 in the CLI)."""
    eos = tokenizer.eos_token_id
    out: list[int] = []
    if per_file <= 0:
        for t in texts(spec, split):
            out.extend(tokenizer(t, add_special_tokens=False)["input_ids"])
            if eos is not None:
                out.append(eos)
            if len(out) >= n_tokens:
                break
    else:
        out = _spread(tokenizer, spec, split, n_tokens, per_file)
    if not out:
        raise UsageError(f"calibration corpus {spec!r} ({split}) is empty: no readable UTF-8 text")
    return out[:n_tokens]


def _spread(tokenizer: Any, spec: str, split: Split, n_tokens: int, per_file: int) -> list[int]:
    eos = tokenizer.eos_token_id
    paths = {rel: p for rel, p in files(spec) if split == "all" or _split_of(rel) == split}
    order = sorted(paths, key=lambda rel: hashlib.sha1(rel.encode()).hexdigest())
    ids: dict[str, list[int]] = {}  # tokenized on first visit: a small pool reads few files
    offset = dict.fromkeys(order, 0)
    out: list[int] = []
    while len(out) < n_tokens:
        taken = 0
        for rel in order:
            if rel not in ids:
                text = _read(paths[rel])
                ids[rel] = tokenizer(text, add_special_tokens=False)["input_ids"] if text.strip() else []
            part = ids[rel][offset[rel] : offset[rel] + per_file]
            if not part:
                continue
            offset[rel] += len(part)
            out.extend(part)
            if eos is not None:
                out.append(eos)
            taken += len(part)
            if len(out) >= n_tokens:
                break
        if not taken:  # every file read to its end
            break
    return out


def raw_text(spec: str, split: Split, n_chars: int) -> str:
    """About ``n_chars`` characters of ``spec``'s ``split`` (for tokenizer-independent perplexity)."""
    parts: list[str] = []
    size = 0
    for t in texts(spec, split):
        parts.append(t)
        size += len(t)
        if size >= n_chars:
            break
    if not parts:
        raise UsageError(f"corpus {spec!r} ({split}) is empty: no readable UTF-8 text")
    return "\n".join(parts)[:n_chars]


def chunks(ids: list[int], seq_len: int) -> Any:
    """``ids`` as a [n, seq_len] LongTensor (the tail that does not fill a row is dropped)."""
    import torch

    n = len(ids) // seq_len
    if n == 0:
        raise UsageError(f"corpus too short: {len(ids)} tokens, need at least one sequence of {seq_len}")
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)

"""An optional local tokenizer for counting output tokens when the server reports no usage.

Only a local path is accepted (no hub downloads): a directory or ``tokenizer.json`` file, read with
the ``tokenizers`` package, or with ``transformers`` when that is installed. Imported lazily.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpufleet.core.errors import UsageError

__all__ = ["LocalTokenizer", "load_tokenizer"]


class LocalTokenizer:
    def __init__(self, impl: Any, kind: str, name: str) -> None:
        self._impl, self.kind, self.name = impl, kind, name

    def count(self, text: str) -> int:
        if self.kind == "tokenizers":
            return len(self._impl.encode(text, add_special_tokens=False).ids)
        return len(self._impl.encode(text, add_special_tokens=False))


def load_tokenizer(name: str) -> LocalTokenizer:
    p = Path(name)
    if not p.exists():
        raise UsageError(f"--tokenizer {name!r}: not a local path (hub downloads are not supported)")
    file = p / "tokenizer.json" if p.is_dir() else p
    try:
        from tokenizers import Tokenizer

        if file.is_file():
            try:
                return LocalTokenizer(Tokenizer.from_file(str(file)), "tokenizers", name)
            except Exception as e:  # noqa: BLE001 - the Rust binding raises plain Exception on bad files
                raise UsageError(f"--tokenizer {name!r}: cannot load {file}: {e}") from None
    except ImportError:
        pass
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise UsageError(
            f"--tokenizer {name!r}: needs the 'tokenizers' or 'transformers' package and a tokenizer.json"
        ) from None
    try:
        impl = AutoTokenizer.from_pretrained(name, local_files_only=True)
        return LocalTokenizer(impl, "transformers", name)
    except (OSError, ValueError) as e:
        raise UsageError(f"--tokenizer {name!r}: cannot load: {e}") from None

"""docs/ledger.md and the event registry agree: every kind documented with exactly its fields, the
optional ones marked ``?`` and the enum values listed; nothing documented that does not exist."""

from __future__ import annotations

import dataclasses
import enum
import re
import types
import typing
from pathlib import Path

from gpufleet.core import events as E

DOC = Path(__file__).resolve().parents[2] / "docs" / "ledger.md"
_FIELD = re.compile(r"`(\w+)`(\?)?(?:\s*\(([^)]*)\))?")


def _rows(section: str) -> list[list[str]]:
    """Table rows (cells) of the markdown sections whose heading starts with ``section``."""
    rows, inside = [], False
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            inside = line[3:].startswith(section)
        elif inside and line.startswith("| `"):
            rows.append([c.strip() for c in line.strip().strip("|").split(" | ")])
    return rows


def _documented_fields(cell: str) -> dict[str, tuple[bool, set[str] | None]]:
    out: dict[str, tuple[bool, set[str] | None]] = {}
    for name, optional, values in _FIELD.findall(cell):
        assert name not in out, f"{name} listed twice in {cell!r}"
        out[name] = (optional == "?", {v.strip() for v in values.split(",")} if values else None)
    return out


def _code_fields(cls: type[E.Event], own: bool) -> dict[str, tuple[bool, set[str] | None]]:
    hints = typing.get_type_hints(cls)
    envelope = {f.name for f in dataclasses.fields(E.Event)}
    out: dict[str, tuple[bool, set[str] | None]] = {}
    for f in dataclasses.fields(cls):
        if own == (f.name in envelope):
            continue
        tp = hints[f.name]
        args = typing.get_args(tp) if typing.get_origin(tp) in (types.UnionType, typing.Union) else (tp,)
        enums = [a for a in args if isinstance(a, type) and issubclass(a, enum.Enum)]
        values = {m.value for m in enums[0]} if enums else None
        optional = f.default is None or f.default == ()
        out[cls.json_names.get(f.name, f.name)] = (optional, values)
    return out


def test_every_event_kind_is_documented_with_its_fields() -> None:
    rows = _rows("Events") + _rows("Fleet ledger")
    kinds = [re.fullmatch(r"`(\w+)`", r[0]).group(1) for r in rows]  # type: ignore[union-attr]
    assert len(kinds) == len(set(kinds)), "a kind documented twice"
    assert set(kinds) == set(E.EVENT_TYPES), (
        f"undocumented: {set(E.EVENT_TYPES) - set(kinds)}; no such kind: {set(kinds) - set(E.EVENT_TYPES)}"
    )
    for kind, row in zip(kinds, rows, strict=True):
        assert len(row) == 4, f"{kind}: expected | ev | who | fields | notes |, got {row}"
        assert _documented_fields(row[2]) == _code_fields(E.EVENT_TYPES[kind], own=True), kind


def test_common_fields_are_the_envelope() -> None:
    doc = {}
    for row in _rows("Common fields"):
        doc.update(_documented_fields(row[0]))
    envelope = _code_fields(E.Step, own=False)
    assert doc == envelope | {"ev": (False, None), "v": (False, None)}

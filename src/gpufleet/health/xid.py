"""XID events from kernel-log text (dmesg / journal), classified by the data table ``data/xid.toml``."""

from __future__ import annotations

import re
import tomllib
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

__all__ = ["XidEvent", "XidClass", "parse_xids", "classify", "xid_table"]

_LINE = re.compile(r"NVRM: Xid \((?:PCI:)?([0-9A-Fa-f:.]+)\): (\d+)(?:,\s*(.*))?")


@dataclass(frozen=True)
class XidEvent:
    pci: str
    code: int
    text: str


@dataclass(frozen=True)
class XidClass:
    code: int
    name: str
    severity: str  # fatal | warn | app
    action: str
    source: str


@lru_cache(maxsize=1)
def xid_table() -> dict[str, Any]:
    return tomllib.loads(resources.files("gpufleet.health").joinpath("data/xid.toml").read_text())


def classify(code: int) -> XidClass:
    t = xid_table()
    name = t.get("names", {}).get(str(code), "")
    for rule in t["rule"]:
        if code in rule["codes"]:
            return XidClass(code, name, rule["severity"], rule["action"], rule["source"])
    return XidClass(code, name, "warn", "unclassified: look it up in NVIDIA's XID catalog", "none")


def parse_xids(text: str) -> list[XidEvent]:
    out = []
    for line in text.splitlines():
        m = _LINE.search(line)
        if m:
            out.append(XidEvent(m.group(1).lower(), int(m.group(2)), (m.group(3) or "").strip()))
    return out


def repeat_suspects(events: list[XidEvent]) -> list[str]:
    """GPUs (PCI ids) on which a repeat-rule XID recurs while no other GPU shows it (NVSentinel)."""
    rule = xid_table().get("repeat", {})
    codes, need = set(rule.get("codes", [])), int(rule.get("count", 3))
    per_gpu = Counter(e.pci for e in events if e.code in codes)
    if len(per_gpu) != 1:
        return []  # none, or spread over many GPUs: an application bug, not the hardware
    ((pci, n),) = per_gpu.items()
    return [pci] if n >= need else []

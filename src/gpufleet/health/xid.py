"""XID and SXID events from kernel-log text (dmesg / journal), classified by ``data/xid.toml``.

Every code maps to an action class (:data:`ACTIONS`: watch, drain, reset_gpu, reboot,
service_required), a severity (the check's status), the reason and NVIDIA's page for the code. XIDs
are GPU errors (``NVRM: Xid (PCI:...): N, ...``); SXIDs are NVSwitch errors
(``nvidia-nvswitchN: SXid (PCI:...): N, Fatal|Non-fatal, ...``).
"""

from __future__ import annotations

import re
import tomllib
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

from gpufleet.core import events as E

__all__ = [
    "ACTIONS",
    "XidEvent",
    "SxidEvent",
    "XidClass",
    "parse_xids",
    "parse_sxids",
    "classify",
    "classify_sxid",
    "xid_table",
    "repeat_suspects",
    "worst_action",
]

ACTIONS = tuple(r.value for r in E.Remedy)  # watch drain reset_gpu reboot service_required
"""Action classes, least to most disruptive."""

_LINE = re.compile(r"NVRM: Xid \((?:PCI:)?([0-9A-Fa-f:.]+)\): (\d+)(?:,\s*(.*))?")
_SXID = re.compile(
    r"(nvidia-nvswitch\d+): SXid \((?:PCI:)?([0-9A-Fa-f:.]+)\): (\d+)(?:,\s*(Fatal|Non-fatal))?(?:,\s*(.*))?",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class XidEvent:
    pci: str
    code: int
    text: str


@dataclass(frozen=True)
class SxidEvent:
    switch: str
    pci: str
    code: int
    fatal: bool | None  # the line's own severity word; None when it has none
    text: str


@dataclass(frozen=True)
class XidClass:
    code: int
    name: str
    severity: str  # fatal | warn | app
    action: str  # one of ACTIONS
    source: str
    reason: str = ""
    url: str = ""


@lru_cache(maxsize=1)
def xid_table() -> dict[str, Any]:
    return tomllib.loads(resources.files("gpufleet.health").joinpath("data/xid.toml").read_text())


def classify(code: int) -> XidClass:
    """The class of XID ``code``; an unlisted code is ``watch`` (WARN) and says so."""
    t = xid_table()
    name = t.get("names", {}).get(str(code), "")
    for rule in t["rule"]:
        if code in rule["codes"]:
            return XidClass(
                code, name, rule["severity"], rule["action"], rule["source"], rule["reason"], t["url"]
            )
    return XidClass(
        code, name, "warn", "watch", "none", "unclassified: look it up in NVIDIA's Xid catalog", t["url"]
    )


def classify_sxid(code: int, fatal: bool | None = None) -> XidClass:
    """The class of SXID ``code``; an unlisted code follows the line's Fatal/Non-fatal word."""
    t = xid_table()["sxid"]
    for rule in t["rule"]:
        if code in rule["codes"]:
            return XidClass(
                code,
                "",
                rule["severity"],
                rule["action"],
                rule["source"],
                rule["reason"],
                xid_table()["sxid_url"],
            )
    if fatal is False:
        return XidClass(
            code, "", "warn", t["nonfatal_action"], "line", t["nonfatal_reason"], xid_table()["sxid_url"]
        )
    reason = t["fatal_reason"] if fatal else "unclassified SXID without a severity word: treated as fatal"
    return XidClass(code, "", "fatal", t["fatal_action"], "line", reason, xid_table()["sxid_url"])


def worst_action(actions: list[str]) -> str:
    """The most disruptive of ``actions`` (``watch`` for none)."""
    return max(actions, key=ACTIONS.index, default="watch")


def parse_xids(text: str) -> list[XidEvent]:
    out = []
    for line in text.splitlines():
        m = _LINE.search(line)
        if m:
            out.append(XidEvent(m.group(1).lower(), int(m.group(2)), (m.group(3) or "").strip()))
    return out


def parse_sxids(text: str) -> list[SxidEvent]:
    out = []
    for line in text.splitlines():
        m = _SXID.search(line)
        if m and not (m.group(4) is None and (m.group(5) or "").startswith("Severity ")):
            # "<code>, Severity N Engine instance ..." continues the event of the line before it
            sev = m.group(4)
            fatal = None if sev is None else sev.lower() == "fatal"
            out.append(
                SxidEvent(m.group(1), m.group(2).lower(), int(m.group(3)), fatal, (m.group(5) or "").strip())
            )
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

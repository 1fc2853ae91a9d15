"""Plan files as the packer reads them (schema ``gpufleet.serve.plan`` v1, docs/serve-plan.md).

Only the placement fields matter here: ``workload``, ``config.mode``, ``gpus`` and ``groups``
(engine instances: ``id``, ``role``, ``gpus``, ``pd_group``). A hand-written file needs only
``workload`` and ``groups``; an optional top-level ``anti_affinity: true`` spreads that workload's
replicas across domains. Anything malformed is a one-line :class:`UsageError`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpufleet.core.errors import UsageError
from gpufleet.serve.common.plan_format import PLAN_SCHEMA, PLAN_VERSION, Mode

__all__ = ["Group", "Item", "Workload", "load_plan", "load_plans", "items_of"]


@dataclass(frozen=True)
class Group:
    """One engine instance: a tensor-parallel group that must sit inside one NVLink domain."""

    workload: str
    id: str
    role: str
    gpus: int
    pd_group: str | None = None


@dataclass(frozen=True)
class Item:
    """What is placed as a whole: a P/D group (role ``pd``) or a lone instance."""

    workload: str
    key: str
    role: str
    groups: tuple[Group, ...]
    order: int = 0

    @property
    def gpus(self) -> int:
        return sum(g.gpus for g in self.groups)

    def label(self) -> str:
        return f"P/D group {self.key!r}" if self.role == "pd" else f"{self.role} {self.key!r}"


@dataclass
class Workload:
    name: str
    mode: Mode
    gpus: int
    groups: list[Group]
    source: str = ""
    anti_affinity: bool = False
    feasible: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


def _int(v: Any, where: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise UsageError(f"{where} must be an integer >= 1 (got {v!r})")
    return v


def parse_plan(doc: Any, source: str) -> Workload:
    """Validate one plan document (already parsed JSON)."""
    w = f"plan {source}"
    if not isinstance(doc, dict):
        raise UsageError(f"{w}: expected a JSON object")
    schema, version = doc.get("schema", PLAN_SCHEMA), doc.get("version", PLAN_VERSION)
    if schema != PLAN_SCHEMA:
        raise UsageError(f"{w}: schema {schema!r} is not a plan ({PLAN_SCHEMA!r})")
    if isinstance(version, bool) or not isinstance(version, int) or version > PLAN_VERSION:
        raise UsageError(
            f"{w}: plan version {version!r} is not supported (this gpufleet reads version <= {PLAN_VERSION})"
        )
    name = doc.get("workload")
    if not isinstance(name, str) or not name.strip():
        raise UsageError(f"{w}: 'workload' must be a non-empty string")
    cfg = doc.get("config") if isinstance(doc.get("config"), dict) else {}
    mode = cfg.get("mode", doc.get("mode"))
    groups_raw = doc.get("groups")
    if not isinstance(groups_raw, list) or not groups_raw:
        raise UsageError(f"{w}: 'groups' must be a non-empty list of placement units")
    groups: list[Group] = []
    seen: set[str] = set()
    for i, g in enumerate(groups_raw):
        if not isinstance(g, dict):
            raise UsageError(f"{w}: groups[{i}] must be an object")
        gid = str(g.get("id", f"g{i}"))
        if gid in seen:
            raise UsageError(f"{w}: group id {gid!r} appears twice")
        seen.add(gid)
        role = g.get("role", "replica")
        if not isinstance(role, str) or not role or role == "pd":
            raise UsageError(f"{w}: groups[{i}].role must be replica, prefill or decode (got {role!r})")
        pd = g.get("pd_group")
        if pd is not None and not isinstance(pd, str | int):
            raise UsageError(f"{w}: groups[{i}].pd_group must be a string or null (got {pd!r})")
        groups.append(
            Group(
                name,
                gid,
                role,
                _int(g.get("gpus"), f"{w}: groups[{i}].gpus"),
                None if pd is None else str(pd),
            )
        )
    if mode is None:
        mode = Mode.DISAGGREGATED if any(g.pd_group for g in groups) else Mode.AGGREGATED
    if mode not in tuple(Mode):
        raise UsageError(f"{w}: mode must be one of {', '.join(Mode)} (got {mode!r})")
    total = sum(g.gpus for g in groups)
    if "gpus" in doc and _int(doc["gpus"], f"{w}: 'gpus'") != total:
        raise UsageError(f"{w}: 'gpus' is {doc['gpus']} but its groups hold {total} GPUs")
    anti = doc.get("anti_affinity", False)
    if not isinstance(anti, bool):
        raise UsageError(f"{w}: 'anti_affinity' must be true or false (got {anti!r})")
    return Workload(name, Mode(mode), total, groups, source, anti, doc.get("feasible", True) is not False)


def load_plan(path: Path) -> Workload:
    try:
        text = path.read_text()
    except OSError as e:
        raise UsageError(f"plan {path}: cannot read it ({e.strerror or e})") from None
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise UsageError(f"plan {path}: not valid JSON ({e})") from None
    return parse_plan(doc, str(path))


def load_plans(paths: list[Path]) -> list[Workload]:
    """Load every plan; a repeated workload name gets a ``-2``, ``-3`` ... suffix."""
    out: list[Workload] = []
    names: set[str] = set()
    for p in paths:
        wl = load_plan(p)
        base, k = wl.name, 2
        while wl.name in names:
            wl.name, k = f"{base}-{k}", k + 1
        if wl.name != base:
            wl.groups = [Group(wl.name, g.id, g.role, g.gpus, g.pd_group) for g in wl.groups]
        names.add(wl.name)
        out.append(wl)
    return out


def items_of(workloads: list[Workload]) -> list[Item]:
    """P/D groups (one item per ``pd_group`` id) and lone instances, in plan order."""
    items: list[Item] = []
    for wl in workloads:
        pd: dict[str, list[Group]] = {}
        for g in wl.groups:
            if g.pd_group is None:
                items.append(Item(wl.name, g.id, g.role, (g,), len(items)))
            elif g.pd_group in pd:
                pd[g.pd_group].append(g)
            else:
                pd[g.pd_group] = [g]
                items.append(Item(wl.name, g.pd_group, "pd", (), len(items)))  # placeholder, filled below
        for j, it in enumerate(items):
            if it.workload == wl.name and it.role == "pd" and not it.groups:
                items[j] = Item(it.workload, it.key, "pd", tuple(pd[it.key]), it.order)
    return items

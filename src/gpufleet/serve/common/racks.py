"""Rack and node types: the NVLink domains a fleet is made of. The one table of them, used by
``serve plan --rack`` (the domain a plan must fit) and ``serve pack --racks`` (the fleet).

A *domain* is a set of GPUs joined by NVLink: a tensor-parallel group, and every P/D group,
must sit inside one. A GB200 NVL72 rack is one domain of 72 GPUs; an HGX node is one of 8.

Fleet grammar (docs/serve-pack.md):

* ``--racks TYPE:COUNT[@COST][,TYPE:COUNT[@COST]...]`` e.g. ``nvl72:4`` or ``nvl72:2,nvl36:4@0.55``
* ``--nodes GPUSxCOUNT[@COST]`` e.g. ``8x16``: 16 nodes of 8 GPUs, NVLink inside each node

COST is the price of using one domain (default 1.0: the objective counts racks/nodes).
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass

from gpufleet.core.errors import UsageError

__all__ = [
    "DomainKind",
    "RackType",
    "Domain",
    "RACK_TYPES",
    "rack_type",
    "parse_racks",
    "parse_nodes",
    "build_fleet",
]


class DomainKind(enum.StrEnum):
    """A whole rack is one NVLink domain, or each node is one."""

    RACK = "rack"
    NODE = "node"


@dataclass(frozen=True)
class RackType:
    """One kind of NVLink domain."""

    name: str
    gpus: int
    description: str
    kind: DomainKind = DomainKind.RACK


@dataclass(frozen=True)
class Domain:
    """One concrete domain of the fleet (``name`` is unique: ``nvl72-0``, ``node-3`` ...)."""

    name: str
    type: str
    gpus: int
    cost: float = 1.0


RACK_TYPES: dict[str, RackType] = {
    "nvl72": RackType("nvl72", 72, "GB200 NVL72: one NVLink domain of 72 GPUs"),
    "nvl36": RackType("nvl36", 36, "GB200 NVL36: one NVLink domain of 36 GPUs"),
    "hgx8": RackType("hgx8", 8, "HGX 8-GPU node: NVLink inside the node", DomainKind.NODE),
}

_MAX_DOMAINS = 10_000
_COST_RE = r"(?:@(?P<cost>[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?))?"
_RACK_RE = re.compile(r"^(?P<type>[A-Za-z0-9_-]+):(?P<count>[0-9]+)" + _COST_RE + r"$")
_NODE_RE = re.compile(r"^(?P<gpus>[0-9]+)x(?P<count>[0-9]+)" + _COST_RE + r"$")


def rack_type(name: str, flag: str = "--racks") -> RackType:
    """The registered type called ``name``; an unknown name lists the valid ones."""
    try:
        return RACK_TYPES[name.strip().lower()]
    except KeyError:
        valid = ", ".join(f"{t.name} ({t.gpus} GPUs)" for t in RACK_TYPES.values())
        raise UsageError(f"{flag}: unknown rack type {name!r}; valid: {valid}") from None


def _cost(text: str | None, where: str) -> float:
    if text is None:
        return 1.0
    c = float(text)
    if not (math.isfinite(c) and c > 0):
        raise UsageError(f"{where}: cost must be > 0 (got {text})")
    return c


def _count(text: str, where: str) -> int:
    n = int(text)
    if not 1 <= n <= _MAX_DOMAINS:
        raise UsageError(f"{where}: count must be in 1..{_MAX_DOMAINS} (got {n})")
    return n


def parse_racks(spec: str) -> list[Domain]:
    """``nvl72:4,nvl36:2@0.55`` → domains ``nvl72-0..3``, ``nvl36-0..1``."""
    out: list[Domain] = []
    seen: dict[str, int] = {}
    for part in (p.strip() for p in spec.split(",")):
        m = _RACK_RE.match(part)
        if not m:
            raise UsageError(f"--racks: expected TYPE:COUNT[@COST] such as nvl72:4 (got {part!r})")
        rt = rack_type(m["type"])
        n, cost = _count(m["count"], f"--racks {part}"), _cost(m["cost"], f"--racks {part}")
        start = seen.get(rt.name, 0)
        out += [Domain(f"{rt.name}-{start + i}", rt.name, rt.gpus, cost) for i in range(n)]
        seen[rt.name] = start + n
    return _checked(out)


def parse_nodes(spec: str) -> list[Domain]:
    """``8x16`` → 16 nodes of 8 GPUs each (``node-0..15``); an 8-GPU node is an ``hgx8``."""
    m = _NODE_RE.match(spec.strip())
    if not m:
        raise UsageError(f"--nodes: expected GPUSxCOUNT[@COST] such as 8x16 (got {spec!r})")
    gpus = int(m["gpus"])
    if not 1 <= gpus <= 1024:
        raise UsageError(f"--nodes {spec}: GPUs per node must be in 1..1024 (got {gpus})")
    n, cost = _count(m["count"], f"--nodes {spec}"), _cost(m["cost"], f"--nodes {spec}")
    kind = "hgx8" if gpus == 8 else f"node{gpus}"
    return _checked([Domain(f"node-{i}", kind, gpus, cost) for i in range(n)])


def _checked(domains: list[Domain]) -> list[Domain]:
    if len(domains) > _MAX_DOMAINS:
        raise UsageError(f"the fleet has {len(domains)} domains; at most {_MAX_DOMAINS} are supported")
    return domains


def build_fleet(racks: str | None, nodes: str | None) -> list[Domain]:
    """Exactly one of ``--racks`` / ``--nodes``."""
    if (racks is None) == (nodes is None):
        raise UsageError(
            "give the fleet as --racks TYPE:COUNT (e.g. nvl72:4) or --nodes GPUSxCOUNT "
            "(e.g. 8x16), exactly one of them"
        )
    return parse_racks(racks) if racks is not None else parse_nodes(nodes or "")

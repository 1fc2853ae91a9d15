"""The import structure of src/gpufleet: layers point one way, and nothing imports itself back.

Layers (docs/architecture.md), lowest first; a module may import its own layer and the ones below::

    core  <-  domain packages  <-  train, backends  <-  gpufleet (the public API), demo  <-  cli

Every import counts: module level, under ``if TYPE_CHECKING:``, and inside functions (a lazy import
is still a dependency; it only moves the moment it is paid). Two checks on cycles:

* modules: no module reaches itself through imports of any kind. A lazy import that closes a loop
  is a cycle that merely happens not to crash at import time;
* top-level packages: no cycle either, which matters inside a layer (domain packages may use each
  other, one way).

Not seen: dynamic imports (``importlib.import_module``), which only registries use, each naming
modules of its own package (backends, health checks, the serve subpackages' lazy re-exports); and
the implicit import of a package's ``__init__`` when one of its modules is imported.

Private means private: no ``obj._name`` on anything but ``self``/``cls``, and no ``_name`` (or
``_module``) imported from another top-level package. Inside one package a private helper module
(``serve/_lazy.py``) or name may be shared.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
ROOT_PACKAGE = "gpufleet"
API = "gpufleet"  # the package's own __init__ (init, Run, StepSampler, the errors): its own layer name

# Lowest first. Packages planned by the design but not written yet are listed where they will sit.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("core",),
    ("checkpoint", "health", "reliability", "serve", "compress", "observe", "fleet"),
    ("train", "backends"),
    # demo: a user of the public API and of the supervisor, like a user's script; ray: the public API
    # inside a Ray Train loop (it calls gpufleet.init)
    (API, "demo", "ray"),
    ("cli",),
)
LAYER_OF = {pkg: i for i, names in enumerate(LAYERS) for pkg in names}


@dataclass(frozen=True)
class Import:
    source: str  # importing module, dotted
    target: str  # imported module (or package), dotted
    file: str  # relative to src/
    line: int
    kind: str  # "top" (runs at import), "type" (under TYPE_CHECKING), "lazy" (inside a function)

    def __str__(self) -> str:
        return f"{self.file}:{self.line} imports {self.target} ({self.kind})"


def find_modules(src: Path, package: str = ROOT_PACKAGE) -> dict[str, tuple[Path, bool]]:
    """dotted name -> (file, is a package __init__), for every .py file under ``src/package``."""
    out: dict[str, tuple[Path, bool]] = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_pkg: bool, known: dict) -> Iterator[str]:
    """The modules of ``package`` that ``node`` imports: ``from a.b import c`` is ``a.b.c`` when that
    is a module, else ``a.b``; a name that is no module maps to the nearest enclosing one."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:  # relative: from the module's package, one level up per extra dot
            base = module.split(".") if is_pkg else module.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            mod = ".".join([*base, node.module] if node.module else base)
        else:
            mod = node.module or ""
        names = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
    for name in names:
        if name != ROOT_PACKAGE and not name.startswith(ROOT_PACKAGE + "."):
            continue
        while name not in known and "." in name:
            name = name.rsplit(".", 1)[0]
        yield name


def parse_imports(src: Path, package: str = ROOT_PACKAGE) -> list[Import]:
    """Every import of ``package``'s own modules by ``package``'s modules."""
    known = find_modules(src, package)
    found: list[Import] = []
    for module, (path, is_pkg) in known.items():
        rel = path.relative_to(src).as_posix()

        def visit(
            node: ast.AST, kind: str, module: str = module, rel: str = rel, is_pkg: bool = is_pkg
        ) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.Import | ast.ImportFrom):
                    for target in _targets(child, module, is_pkg, known):
                        if target != module:
                            found.append(Import(module, target, rel, child.lineno, kind))
                elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                    visit(child, "lazy")
                elif isinstance(child, ast.If) and _is_type_checking(child.test):
                    for stmt in child.body:
                        visit(ast.Module(body=[stmt], type_ignores=[]), "type" if kind == "top" else kind)
                    for stmt in child.orelse:
                        visit(ast.Module(body=[stmt], type_ignores=[]), kind)
                else:
                    visit(child, kind)

        visit(ast.parse(path.read_text(), filename=str(path)), "top")
    return found


def top_package(module: str) -> str:
    """``gpufleet.serve.bench.runner`` -> ``serve``; the root package itself -> ``gpufleet``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def layer_violations(imports: Iterable[Import]) -> list[str]:
    out = []
    for imp in imports:
        src, dst = top_package(imp.source), top_package(imp.target)
        if src in LAYER_OF and dst in LAYER_OF and LAYER_OF[dst] > LAYER_OF[src]:
            out.append(f"{imp}: layer {LAYER_OF[src]} ({src}) must not import layer {LAYER_OF[dst]} ({dst})")
    return out


def find_cycles(edges: dict[str, dict[str, Import]]) -> list[list[Import]]:
    """One cycle (as its imports, in order) per strongly connected component of more than one node."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan; the graphs are small, recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, {})):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    cycles = []
    for comp in components:
        members, start = set(comp), comp[0]
        # breadth-first from start back to start inside the component: the shortest loop through it
        prev: dict[str, tuple[str, Import]] = {}
        frontier, seen, end = [start], {start}, None
        while frontier and end is None:
            nxt = []
            for v in frontier:
                for w, imp in sorted(edges.get(v, {}).items()):
                    if w == start:
                        end = (v, imp)
                        break
                    if w in members and w not in seen:
                        seen.add(w)
                        prev[w] = (v, imp)
                        nxt.append(w)
                if end is not None:
                    break
            frontier = nxt
        assert end is not None
        path, v = [end[1]], end[0]
        while v != start:
            v, imp = prev[v]
            path.append(imp)
        cycles.append(path[::-1])
    return cycles


def module_graph(imports: Iterable[Import]) -> dict[str, dict[str, Import]]:
    g: dict[str, dict[str, Import]] = {}
    for imp in imports:
        g.setdefault(imp.source, {}).setdefault(imp.target, imp)
    return g


def package_graph(imports: Iterable[Import]) -> dict[str, dict[str, Import]]:
    g: dict[str, dict[str, Import]] = {}
    for imp in imports:
        src, dst = top_package(imp.source), top_package(imp.target)
        if src != dst:
            g.setdefault(src, {}).setdefault(dst, imp)
    return g


def describe(cycle: list[Import]) -> str:
    return " -> ".join([cycle[0].source, *(i.target for i in cycle)]) + "".join(f"\n    {i}" for i in cycle)


# ----------------------------------------------------------------------------- the tree itself


@pytest.fixture(scope="module")
def imports() -> list[Import]:
    found = parse_imports(SRC)
    # The parser sees the tree: many imports, of every kind, across packages.
    assert len(found) > 100, len(found)
    assert {i.kind for i in found} == {"top", "type", "lazy"}
    assert any(top_package(i.source) == "train" and top_package(i.target) == "core" for i in found)
    return found


def test_every_package_has_a_layer() -> None:
    packages = {top_package(m) for m in find_modules(SRC)}
    unplaced = sorted(packages - set(LAYER_OF))
    assert not unplaced, (
        f"packages without a layer: {unplaced}; add each to LAYERS in {Path(__file__).name} "
        "and to docs/architecture.md"
    )


def test_layers_point_one_way(imports: list[Import]) -> None:
    bad = layer_violations(imports)
    assert not bad, "imports that point up the layers:\n" + "\n".join(bad)


def test_no_import_cycles_between_modules(imports: list[Import]) -> None:
    cycles = find_cycles(module_graph(imports))
    assert not cycles, "import cycles between modules:\n" + "\n".join(describe(c) for c in cycles)


def test_no_import_cycles_between_packages(imports: list[Import]) -> None:
    cycles = find_cycles(package_graph(imports))
    assert not cycles, "import cycles between packages:\n" + "\n".join(describe(c) for c in cycles)


# Public API despite the underscore: os._exit, sys._getframe, namedtuple's methods.
PUBLIC_UNDERSCORE = {"_exit", "_getframe", "_current_frames", "_replace", "_asdict", "_fields", "_make"}
# (file under src/, expression): a third-party object's private state with no public way to reach it
PRIVATE_ALLOWED = {
    # torch's DataLoader keeps its persistent-workers iterator in _iterator; dropping it is the only
    # way to make it re-read the sampler (train/data.py explains)
    ("gpufleet/train/data.py", "self.loader._iterator"),
    # torch has no public query for oneDNN's bf16 support (AVX-512 / AMX; on AVX2 bf16 is emulated,
    # ~9x slower than fp32); compress picks its default precision by it (compress/model.py)
    ("gpufleet/compress/model.py", "torch.ops.mkldnn._is_mkldnn_bf16_supported"),
    # DDP's own API for moving an instance to a re-formed process group ("shrink/expand DDP world size
    # without having to reinitialize DDP"); in-place rejoin and hot spares need it (train/exactddp.py)
    ("gpufleet/train/exactddp.py", "ddp._update_process_group"),
    ("gpufleet/train/exactddp.py", "self.ddp._update_process_group"),
    # DDP's hook for its per-forward buffer broadcast, and that broadcast itself (the hook runs it as
    # DDP does, absorbing a dead peer's error for in-place rejoin)
    ("gpufleet/train/exactddp.py", "ddp._register_buffer_comm_hook"),
    ("gpufleet/train/exactddp.py", "self.ddp._default_broadcast_coalesced"),
}


def private_reaches(src: Path, package: str = ROOT_PACKAGE) -> list[str]:
    """``obj._x`` on anything but self/cls; ``_x`` imported from another top-level package."""
    out = []
    for module, (path, _) in find_modules(src, package).items():
        rel = path.relative_to(src).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                if node.attr in PUBLIC_UNDERSCORE:
                    continue
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    continue
                expr = ast.unparse(node)
                if (rel, expr) not in PRIVATE_ALLOWED:
                    out.append(f"{rel}:{node.lineno} reads {expr}")
            elif isinstance(node, ast.ImportFrom):
                names = [(node.module or "", a.name) for a in node.names]
                for mod, name in names:
                    if node.level or not mod.startswith(package + "."):
                        continue  # relative imports stay inside the package
                    parts = [*mod.split("."), name]
                    private = any(p.startswith("_") and not p.startswith("__") for p in parts[1:])
                    if private and top_package(mod) != top_package(module):
                        out.append(f"{rel}:{node.lineno} imports {mod}.{name} (private, another package)")
    return out


def test_no_reaching_into_private_attributes() -> None:
    bad = private_reaches(SRC)
    assert not bad, "private state used from outside:\n" + "\n".join(bad)


# ----------------------------------------------------------------------------- the checker itself


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / ROOT_PACKAGE / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def test_checker_names_an_upward_import_and_a_cycle(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "__init__.py": "",
            "core/__init__.py": "",
            "core/errors.py": "def f():\n    from gpufleet.cli import main\n",  # lazy, still upward
            "cli/__init__.py": "",
            "cli/main.py": "from gpufleet.core import errors\n",
            "serve/__init__.py": "",
            "serve/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import b\n",
            "serve/b.py": "import gpufleet.serve.a\n",
            "serve/c.py": "from gpufleet.serve.b import thing\nimport os, json\n",
        },
    )
    found = parse_imports(tmp_path)
    bad = layer_violations(found)
    assert bad == [
        "gpufleet/core/errors.py:2 imports gpufleet.cli.main (lazy): "
        "layer 0 (core) must not import layer 4 (cli)"
    ]
    cycles = find_cycles(module_graph(found))
    assert [[(i.source, i.target, i.kind) for i in c] for c in cycles] == [
        [
            ("gpufleet.cli.main", "gpufleet.core.errors", "top"),
            ("gpufleet.core.errors", "gpufleet.cli.main", "lazy"),
        ],
        [("gpufleet.serve.a", "gpufleet.serve.b", "type"), ("gpufleet.serve.b", "gpufleet.serve.a", "top")],
    ]
    assert describe(cycles[1]).startswith("gpufleet.serve.a -> gpufleet.serve.b -> gpufleet.serve.a\n")
    # core -> cli and cli -> core: a cycle between packages too
    assert [[i.source for i in c] for c in find_cycles(package_graph(found))] == [
        ["gpufleet.cli.main", "gpufleet.core.errors"]
    ]


def test_checker_names_private_reaches(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "__init__.py": "",
            "core/__init__.py": "",
            "core/a.py": "def _h(): ...\nclass A:\n    def f(self):\n        return self._x, other._y\n",
            "core/b.py": "from gpufleet.core.a import _h\n",  # same package: allowed
            "cli/__init__.py": "",
            "cli/m.py": "from gpufleet.core.a import _h\nfrom gpufleet.core import _private_mod\n",
        },
    )
    assert sorted(private_reaches(tmp_path)) == [
        "gpufleet/cli/m.py:1 imports gpufleet.core.a._h (private, another package)",
        "gpufleet/cli/m.py:2 imports gpufleet.core._private_mod (private, another package)",
        "gpufleet/core/a.py:4 reads other._y",
    ]

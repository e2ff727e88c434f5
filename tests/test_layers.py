"""The layers of the project: which module may import which, and no import cycles.

Checked on the source with ``ast`` (imports inside functions included, relative imports resolved),
so a lazy import cannot hide a dependency that runs against the layering. ``from pkg import name``
imports the module ``pkg.name`` when there is one, else ``pkg`` (its ``__init__``). Modules that
``importlib`` imports by a string (the lazy public names of ``rollout`` and ``instrumentation``) are
not seen.

- Inside ``rollout/`` (README "Map"): each part (a sub-package or a top-level module) has a layer
  in :data:`LAYER` and imports only parts of its own layer or below, and the third-party packages of
  :data:`THIRD_PARTY` (``instrumentation`` from layer 2 up).
- Between packages (:data:`PACKAGE_RANK`): a package imports only packages of a lower rank.
  ``instrumentation`` imports none of ours; ``rollout`` and ``traces`` (one rank) import
  ``instrumentation`` and never each other; ``benchmarks`` (when it exists) may import those three;
  ``scripts`` sit on top. No library imports ``benchmarks``, ``scripts`` or ``tests``.
- One number column orders every part (README "Map", :func:`map_rows`): rollout's parts keep their
  layer (0 to 9); the other packages take :data:`MAP_NUMBER`: ``instrumentation`` 1, below layer 2
  (the first that imports it), and ``traces`` 10, ``benchmarks`` 11, ``scripts`` 12, above rollout's
  top layer. An import of another package goes to a strictly lower number (so rollout's layers 0 and
  1 do not import ``instrumentation``, which shares number 1); inside a package, to the same number
  or lower.
- No import cycle between the packages, nor between the modules of the libraries (``rollout``,
  ``instrumentation``, ``traces``, ``benchmarks``); each cycle found is reported as ``a -> b -> a``.
"""

import ast
import collections
import functools
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "rollout"

#: Layer of each part of ``rollout`` (a sub-package, or a top-level module).
LAYER = {
    "checks": 0, "_packages": 0, "__init__": 0, "config": 1, "planner": 1, "plan": 1, "request": 2, "ops": 2, "model": 3, "cache": 4, "stats": 5, "executors": 6, "engine": 7, "opsd": 8,
    "testing": 9, "real_model": 9, "job": 9,
}
#: Third-party packages each layer may import (the standard library is always allowed).
THIRD_PARTY = {
    0: set(), 1: {"numpy", "scipy"}, 2: {"torch", "numpy", "instrumentation", "triton"},  # ops: our GPU kernels
    3: {"torch", "numpy", "transformers", "deepspeed", "peft", "instrumentation"},
}
#: Allowed everywhere from layer 4 up.
ANY = {"torch", "numpy", "scipy", "transformers", "deepspeed", "peft", "instrumentation", "gguf", "triton",
       "safetensors"}  # safetensors: real_model's conversion cache (a dependency of transformers)
STDLIB = set(sys.stdlib_module_names)

#: Rank of each of our top-level packages: a package imports only packages of a lower rank.
PACKAGE_RANK = {"instrumentation": 0, "rollout": 1, "traces": 1, "benchmarks": 2, "scripts": 3}
#: The packages whose modules must not import each other in a cycle (``benchmarks`` may not exist).
LIBRARIES = ("rollout", "instrumentation", "traces", "benchmarks")
#: Number of each package but ``rollout`` in the one column that orders all parts (rollout's: LAYER).
MAP_NUMBER = {"instrumentation": 1, "traces": 10, "benchmarks": 11, "scripts": 12}
#: Top-level names that are ours: importing one that is not in PACKAGE_RANK (``tests``) is a violation.
OURS = set(PACKAGE_RANK) | {"tests"}


def _module(path: pathlib.Path) -> str:
    """``rollout/plan/layout.py`` -> ``rollout.plan.layout``; ``rollout/plan/__init__.py`` -> ``rollout.plan``."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    """Whether ``name`` is a module or a package of this repository."""
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _part(module: str) -> str:
    """``rollout.plan.layout`` -> ``plan``; ``rollout.engine`` -> ``engine``; ``rollout`` -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: pathlib.Path) -> list[str]:
    """The modules ``path`` imports, each once: dotted names, relative ones resolved."""
    module = _module(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            for alias in node.names:  # a submodule, or a name of ``source``
                sub = f"{source}.{alias.name}"
                out.append(sub if alias.name != "*" and _is_module(sub) else source)
    return list(dict.fromkeys(out))


def _violations(path: pathlib.Path) -> list[str]:
    own = _part(_module(path))
    layer = LAYER[own]
    bad = []
    for target in _imports(path):
        top = target.split(".")[0]
        if top == "rollout":
            other = _part(target)
            if other not in LAYER:
                bad.append(f"{target} (not in the layer table)")
            elif LAYER[other] > layer and other != own:
                bad.append(f"{target} (layer {LAYER[other]} > {layer})")
        elif top not in STDLIB and top not in (ANY if layer >= 4 else THIRD_PARTY[layer]):
            bad.append(f"{target} (third-party, not allowed in layer {layer})")
    return bad


def _number(module: str):
    """The map number of the part ``module`` belongs to (None: a rollout part missing from LAYER)."""
    top = module.split(".")[0]
    return LAYER.get(_part(module)) if top == "rollout" else MAP_NUMBER[top]


def _package_violations(path: pathlib.Path) -> list[str]:
    """Imports of another package of ours that its rank or its map number does not allow."""
    module = _module(path)
    own = module.split(".")[0]
    bad = []
    for target in _imports(path):
        top = target.split(".")[0]
        if top == own or top not in OURS:
            continue
        if top not in PACKAGE_RANK:
            bad.append(f"{target} (not in the package table)")
        elif PACKAGE_RANK[top] >= PACKAGE_RANK[own]:
            bad.append(f"{target} (rank {PACKAGE_RANK[top]}, not below {own}'s {PACKAGE_RANK[own]})")
        elif None not in (_number(module), _number(target)) and _number(target) >= _number(module):
            bad.append(f"{target} (map number {_number(target)}, not below {_number(module)})")
    return bad


def _sources(packages) -> list[pathlib.Path]:
    return [path for package in packages for path in sorted((ROOT / package).rglob("*.py"))]


@functools.lru_cache(maxsize=None)
def module_graph() -> dict[str, frozenset]:
    """Module of a library -> the modules of the libraries it imports (itself left out)."""
    paths = _sources(LIBRARIES)
    names = {_module(path) for path in paths}
    return {_module(p): frozenset(t for t in _imports(p) if t in names and t != _module(p)) for p in paths}


def package_graph() -> dict[str, set]:
    """Library -> the other libraries its modules import."""
    graph = collections.defaultdict(set)
    for module, targets in module_graph().items():
        top = module.split(".")[0]
        graph[top] |= {t.split(".")[0] for t in targets} - {top}
    return dict(graph)


def cycles(graph) -> list[str]:
    """The shortest cycle through each node that is on one, as ``a -> b -> a`` (from its least node; each once)."""
    found = set()
    for start in sorted(graph):
        came_from = {node: start for node in sorted(graph[start])}
        queue = collections.deque(came_from)
        while queue and start not in came_from:  # breadth first: the first way back is a shortest one
            node = queue.popleft()
            for succ in sorted(graph.get(node, ())):
                if succ not in came_from:
                    came_from[succ] = node
                    queue.append(succ)
        if start in came_from:
            path, node = [], came_from[start]
            while node != start:
                path.append(node)
                node = came_from[node]
            loop = [start] + path[::-1]
            first = loop.index(min(loop))
            loop = loop[first:] + loop[:first]
            found.add(" -> ".join(loop + loop[:1]))
    return sorted(found)


def map_rows() -> list[tuple[int, str]]:
    """``(number, part)`` of the README map: rollout's parts (``rollout/plan``, ``rollout/engine.py``)
    and the other packages, by number (within a number: rollout's parts in LAYER's order first)."""
    def name(part: str) -> str:
        return f"rollout/{part}" if (PACKAGE / part).is_dir() else f"rollout/{part}.py"

    rows = [(layer, name(part)) for part, layer in LAYER.items()] + [(n, p) for p, n in MAP_NUMBER.items()]
    return sorted(rows, key=lambda row: row[0])


def _probe(monkeypatch, folder: pathlib.Path, source: str) -> pathlib.Path:
    """A module ``_layer_probe.py`` in ``folder`` whose text is ``source`` (nothing written)."""
    fake = folder / "_layer_probe.py"
    monkeypatch.setattr(pathlib.Path, "read_text", lambda self, *a, **k: source if self == fake else
                        pathlib.Path.read_bytes(self).decode())
    return fake


MODULES = sorted(PACKAGE.rglob("*.py"))
ALL_MODULES = _sources(PACKAGE_RANK)


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(ROOT)) for p in MODULES])
def test_module_imports_respect_the_layers(path):
    assert _part(_module(path)) in LAYER, f"{path}: add it to LAYER"
    assert _violations(path) == []


@pytest.mark.parametrize("path", ALL_MODULES, ids=[str(p.relative_to(ROOT)) for p in ALL_MODULES])
def test_module_imports_respect_the_packages(path):
    assert _package_violations(path) == []


def test_every_package_and_part_is_in_the_tables():
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests"}
    assert packages <= set(PACKAGE_RANK) and set(MAP_NUMBER) == set(PACKAGE_RANK) - {"rollout"}
    assert set(LIBRARIES) == set(PACKAGE_RANK) - {"scripts"}
    assert [part for part in LAYER if not _is_module(f"rollout.{part}") and part != "__init__"] == []


@pytest.mark.parametrize("source, bad", [
    ("import torch\n", "torch"),
    ("from rollout.executors.graphs import GraphSet\n", "rollout.executors.graphs"),
    ("def f():\n    from rollout.model import compat\n", "rollout.model"),
])
def test_a_plan_module_importing_an_upper_layer_is_caught(tmp_path, source, bad, monkeypatch):
    """The check itself: a pure planning module that imports torch, an executor or (lazily) the model layer."""
    fake = _probe(monkeypatch, PACKAGE / "plan", source)
    assert any(bad in v for v in _violations(fake))


@pytest.mark.parametrize("where, source, bad", [
    ("instrumentation", "def f():\n    from traces.table import render\n", "traces.table (rank 1"),
    ("instrumentation", "from ..rollout import engine\n", "rollout.engine (rank 1"),
    ("traces", "from rollout import Rollout\n", "rollout (rank 1"),
    ("rollout/ops", "import traces\n", "traces (rank 1"),
    ("rollout/opsd", "from benchmarks import x\n", "benchmarks (rank 2"),
    ("traces", "from scripts import train_opsd\n", "scripts.train_opsd (rank 3"),
    ("benchmarks", "from scripts import train_opsd\n", "scripts.train_opsd (rank 3"),
    ("instrumentation", "import tests.oracles\n", "tests.oracles (not in the package table)"),
    ("rollout/plan", "from instrumentation import stages\n", "instrumentation.stages (map number 1, not below 1)"),
])
def test_a_module_importing_a_package_above_it_is_caught(where, source, bad, monkeypatch):
    """The package check itself: upward and sideways imports, lazy and relative ones included."""
    fake = _probe(monkeypatch, ROOT / where, source)
    assert [v for v in _package_violations(fake) if v.startswith(bad)], _package_violations(fake)


def test_ops_do_not_import_the_model_layer():
    for path in (PACKAGE / "ops").rglob("*.py"):
        assert not [t for t in _imports(path) if t.startswith(("rollout.model", "rollout.executors"))], path


def test_from_imports_name_the_submodule_or_the_package():
    """``from pkg import module`` imports the module, ``from pkg import name`` the package's ``__init__``."""
    imports = _imports(ROOT / "rollout" / "opsd" / "__init__.py")
    assert "rollout.opsd.step" in imports and "rollout.opsd" not in imports
    assert "instrumentation.stages" in _imports(ROOT / "traces" / "report.py")
    assert "instrumentation" in _imports(ROOT / "rollout" / "engine.py")


def test_cycles_are_reported_as_paths():
    graph = {"a": {"b"}, "b": {"a", "c"}, "c": {"d"}, "d": {"b"}, "e": {"a"}}
    assert cycles(graph) == ["a -> b -> a", "b -> c -> d -> b"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_cycle_between_packages():
    graph = package_graph()
    assert {"rollout", "instrumentation", "traces"} <= set(graph)
    assert cycles(graph) == []


def test_no_import_cycle_between_modules():
    graph = module_graph()
    assert sum(len(targets) for targets in graph.values()) > 100  # the graph was read
    assert cycles(graph) == []


def _readme_map() -> list[tuple[int, str]]:
    text = (ROOT / "README.md").read_text()
    section = re.search(r"^## Map\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert section, "README.md has no '## Map' section"
    return [(int(n), part) for n, part in re.findall(r"^\| *(\d+) *\| *`([^`]+)` *\|", section.group(1), re.M)]


def test_readme_map_matches_the_layer_table():
    """README's ``## Map`` lists every part once, with its number, in number order (any order within one)."""
    rows = _readme_map()
    assert [n for n, _ in rows] == sorted(n for n, _ in rows), "map rows not in number order"
    assert sorted(rows) == sorted(map_rows())


def test_the_engine_imports_few_modules_and_no_route_internals():
    """``rollout/engine.py`` plans and post-processes: at most 10 project modules, none inside a route
    (``rollout.executors.ordinary`` / ``.continuous``); routes are reached through the runner's executors."""
    project = [m for m in _imports(PACKAGE / "engine.py") if m.split(".")[0] in PACKAGE_RANK]
    assert len(project) <= 10, project
    assert not [m for m in project if m.startswith(("rollout.executors.ordinary", "rollout.executors.continuous"))]

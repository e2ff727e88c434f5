"""The layers of ``rollout/`` (README "Layout"): each module imports only from its own layer or below.

Checked on the source with ``ast`` (imports inside functions included), so a lazy import cannot hide a
dependency that runs against the layering.
"""

import ast
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "rollout"

#: Layer of each part of ``rollout`` (a sub-package, or a top-level module).
LAYER = {
    "checks": 0, "_packages": 0, "__init__": 0, "config": 1, "planner": 1, "plan": 1, "request": 2, "ops": 2, "model": 3, "cache": 4, "stats": 5, "executors": 6, "engine": 7, "opsd": 8,
    "testing": 9, "real_model": 9,
}
#: Third-party packages each layer may import (the standard library is always allowed).
THIRD_PARTY = {
    0: set(), 1: {"numpy", "scipy"}, 2: {"torch", "numpy", "instrumentation", "triton"},  # ops: our GPU kernels
    3: {"torch", "numpy", "transformers", "deepspeed", "peft", "instrumentation"},
}
#: Allowed everywhere from layer 4 up.
ANY = {"torch", "numpy", "scipy", "transformers", "deepspeed", "peft", "instrumentation", "gguf", "triton"}
STDLIB = set(sys.stdlib_module_names)


def _part(module: str) -> str:
    """``rollout.plan.layout`` -> ``plan``; ``rollout.engine`` -> ``engine``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: pathlib.Path):
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".")[:-node.level]
                yield ".".join(base + ([node.module] if node.module else []))
            else:
                yield node.module


def _violations(path: pathlib.Path) -> list[str]:
    own = _part(".".join(path.relative_to(ROOT).with_suffix("").parts))
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


MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(ROOT)) for p in MODULES])
def test_module_imports_respect_the_layers(path):
    assert _part(".".join(path.relative_to(ROOT).with_suffix("").parts)) in LAYER, f"{path}: add it to LAYER"
    assert _violations(path) == []


@pytest.mark.parametrize("source, bad", [
    ("import torch\n", "torch"),
    ("from rollout.executors.graphs import GraphSet\n", "rollout.executors.graphs"),
    ("def f():\n    from rollout.model import compat\n", "rollout.model"),
])
def test_a_plan_module_importing_an_upper_layer_is_caught(tmp_path, source, bad, monkeypatch):
    """The check itself: a pure planning module that imports torch, an executor or (lazily) the model layer."""
    fake = PACKAGE / "plan" / "_layer_probe.py"
    monkeypatch.setattr(pathlib.Path, "read_text", lambda self, *a, **k: source if self == fake else
                        pathlib.Path.read_bytes(self).decode())
    assert any(bad in v for v in _violations(fake))


def test_ops_do_not_import_the_model_layer():
    for path in (PACKAGE / "ops").rglob("*.py"):
        assert not [t for t in _imports(path) if t.startswith(("rollout.model", "rollout.executors"))], path

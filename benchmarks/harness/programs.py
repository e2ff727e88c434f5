"""The user programs of ``scripts/`` that benchmarks run: their paths, and ``train_opsd.py`` loaded from its file.

``benchmarks`` imports nothing of the package ``scripts`` (it sits above benchmarks: tests/test_layers.py). Two
benchmarks need more of ``scripts/train_opsd.py`` than its command line: ``benchmarks.multigpu`` checks the flags it
passes through with the program's own parser before launching anything, and ``benchmarks.profiler_cost --workload
opsd`` times the program's OPSD step in its own process. Until the step builder of the main job lives in a library
(``rollout.opsd``), they load the program from its file here, in this one place.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent.parent.parent
TRAIN_SCRIPT = REPO / "scripts" / "train_opsd.py"
SUMMARIZE_SCRIPT = REPO / "scripts" / "summarize_trace.py"
_LOADED: dict[str, ModuleType] = {}


def train_opsd() -> ModuleType:
    """``scripts/train_opsd.py`` as a module (loaded once; the standard library only at load)."""
    if "train_opsd" not in _LOADED:
        spec = importlib.util.spec_from_file_location("_benchmarks_train_opsd", TRAIN_SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses resolve their module while the classes are built
        spec.loader.exec_module(module)
        _LOADED["train_opsd"] = module
    return _LOADED["train_opsd"]

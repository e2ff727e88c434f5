"""The user programs of ``scripts/`` that benchmarks launch: their paths.

``benchmarks`` imports nothing of the package ``scripts`` (it sits above benchmarks: tests/test_layers.py); it runs
the programs as subprocesses. What a benchmark needs of the main job in its own process (``benchmarks.multigpu``: the
job's flag parser; ``benchmarks.profiler_cost --workload opsd``: its OPSD step) comes from the library the program is
built on, :mod:`rollout.job`.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
TRAIN_SCRIPT = REPO / "scripts" / "train_opsd.py"
SUMMARIZE_SCRIPT = REPO / "scripts" / "summarize_trace.py"

"""The ``meta`` of a result file: when, where, on which versions and commit, by which command.

Versions are read from the installed distributions (``importlib.metadata``), so recording them imports
nothing heavy (no ``deepspeed`` import for its version); CUDA's from ``torch.version.cuda`` once torch is
loaded (every benchmark that runs a model has loaded it by then).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys
import time
from typing import Optional, Sequence

#: Distributions whose versions every result records (None where not installed).
VERSIONED = ("torch", "transformers", "triton", "deepspeed")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def versions() -> dict:
    """``{"python", "torch", "cuda", "transformers", "triton", "deepspeed"}`` -> version (None: absent)."""
    out = {"python": platform.python_version()}
    for name in VERSIONED:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    torch = sys.modules.get("torch")
    out["cuda"] = getattr(getattr(torch, "version", None), "cuda", None)
    return out


def git_commit(folder: str = REPO) -> Optional[str]:
    """``git rev-parse HEAD`` of ``folder`` (None outside a checkout or without git)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=folder, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def device_name(device: str = "cpu") -> str:
    """The GPU's name on CUDA, else the processor's (or ``"cpu"``)."""
    if str(device).startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(device)
    return platform.processor() or "cpu"


def run_meta(benchmark: str, argv: Sequence[str], device: str = "cpu", **extra) -> dict:
    """The meta of one run of ``python -m benchmarks.<benchmark> <argv>``; ``extra``: what the benchmark adds."""
    return {"benchmark": benchmark, "date": time.strftime("%Y-%m-%d %H:%M"), "gpu": device_name(device),
            "device": str(device), "versions": versions(), "commit": git_commit(),
            "command": ["python", "-m", f"benchmarks.{benchmark}", *argv], **extra}


def header(meta: dict) -> str:
    """One line naming the run (printed above a benchmark's table)."""
    v = meta.get("versions", {})
    names = ", ".join(f"{k} {v[k]}" for k in ("torch", "cuda", "transformers", "triton") if v.get(k))
    commit = (meta.get("commit") or "no commit")[:10]
    return f"# {meta.get('benchmark', '?')}: {meta.get('date')} {meta.get('gpu')}; {names}; commit {commit}"

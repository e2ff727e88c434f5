"""Work of each stage from a run's work sidecars (``rank{R}.work.jsonl``, :mod:`instrumentation.worklog`).

:func:`read_work` reads the sidecars in the folders of a report's trace files; a bad line (not JSON, an unknown
stage, a negative or non-finite number) is skipped, with one warning per file naming it. :func:`stage_work` sets
each stage's work over the (rank, step) pairs of the trace against the recorded peak rates: per step,
``roofline ms = max(bytes / copy bytes/s, flops / peak FLOP/s)`` summed over the stage's lines and divided by the
number of pairs, where a line's exact ``roofline_s`` (decode's: a sum over its steps, written when the run knew its
rates) is preferred to that max (older lines have none); ``limit`` is ``memory`` or ``compute``, whichever term is
the larger in all. A trace without sidecars gets no work (its report is unchanged).
"""

from __future__ import annotations

import glob
import json
import math
import os
from dataclasses import dataclass
from typing import Optional

from instrumentation import stages as S
from instrumentation.roofline import Rates, work_roofline_s

WORK_GLOB = "rank*.work.jsonl"
_COUNTS = ("step", "rank", "rows", "tokens")
_RATES = ("peak_flops_s", "copy_bytes_s")


@dataclass(frozen=True)
class WorkLine:
    """One sidecar line: a stage's work in one step of one rank."""

    rank: int
    step: int
    stage: str
    """Full range name (``opsd/backward``)."""
    flops: float
    bytes: float
    peak_flops_s: Optional[float]
    copy_bytes_s: Optional[float]
    roofline_s: Optional[float] = None
    """The line's exact least time (seconds) at the run's rates; None: max(bytes / copy, flops / peak)."""


@dataclass(frozen=True)
class WorkFigures:
    """A stage's work per recorded step, and how far its GPU time is from the roofline."""

    flops: float
    """Matmul FLOPs per step (mean over the trace's steps)."""
    bytes: float
    """Bytes to move per step."""
    roofline_ms: Optional[float] = None
    """Least time per step the peak rates allow; None when a line has no rates (the CPU)."""
    x_roofline: Optional[float] = None
    """GPU ms per step over ``roofline_ms``; None without GPU time or roofline."""
    limit: Optional[str] = None
    """``memory`` or ``compute``: the larger term of the roofline; None without it."""

    def to_dict(self) -> dict:
        return {"flops": self.flops, "bytes": self.bytes, "roofline_ms": self.roofline_ms,
                "x_roofline": self.x_roofline, "limit": self.limit}


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a number")


def parse_line(text: str) -> WorkLine:
    """A :class:`WorkLine`; ``ValueError`` saying what is wrong."""
    d = json.loads(text, parse_constant=_reject_constant)
    if not isinstance(d, dict):
        raise ValueError("not a JSON object")
    for key in _COUNTS:
        if isinstance(d.get(key), bool) or not isinstance(d.get(key), int) or d[key] < 0:
            raise ValueError(f"{key}: {d.get(key)!r} is not an int >= 0")
    for key in ("flops", "bytes") + _RATES + ("roofline_s",):
        value = d.get(key)
        optional = key in _RATES + ("roofline_s",) and value is None
        if not optional and (isinstance(value, bool) or not isinstance(value, (int, float))
                             or not math.isfinite(value) or value < 0 or (key in _RATES and value == 0)):
            raise ValueError(f"{key}: {value!r} is not a finite number >= 0")
    if d.get("stage") not in S.ALL_STAGES:
        raise ValueError(f"stage: {d.get('stage')!r} is not a stage")
    return WorkLine(d["rank"], d["step"], S.range_name(d["stage"]), float(d["flops"]), float(d["bytes"]),
                    d.get("peak_flops_s"), d.get("copy_bytes_s"), d.get("roofline_s"))


def read_file(path: str, warnings: list[str]) -> list[WorkLine]:
    """The good lines of one sidecar; bad ones counted in one warning naming ``path``."""
    out, bad, first = [], 0, ""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for number, text in enumerate(f, 1):
                if not text.strip():
                    continue
                try:
                    out.append(parse_line(text))
                except (ValueError, RecursionError) as exc:
                    bad, first = bad + 1, first or f"line {number}: {exc}"
    except OSError as exc:
        warnings.append(f"{path}: cannot read the work sidecar ({exc.strerror or exc}); no work figures from it")
        return []
    if bad:
        warnings.append(f"{path}: {bad} bad work line{'s' if bad != 1 else ''} skipped ({first})")
    return out


def read_work(trace_paths: list[str], warnings: list[str]) -> list[WorkLine]:
    """Every work line in the folders of ``trace_paths`` (each folder once)."""
    folders = sorted({os.path.dirname(os.path.abspath(p)) for p in trace_paths})
    return [line for folder in folders for path in sorted(glob.glob(os.path.join(folder, WORK_GLOB)))
            for line in read_file(path, warnings)]


def stage_work(lines: list[WorkLine], pairs: set, gpu_ms_per_step: dict) -> dict[str, WorkFigures]:
    """Per stage name: its :class:`WorkFigures` over the (rank, step) ``pairs`` of the trace (lines of other
    steps are left out); ``gpu_ms_per_step``: the stage's mean GPU ms per step (None without GPU time)."""
    by_stage: dict[str, list[WorkLine]] = {}
    for line in lines:
        if (line.rank, line.step) in pairs:
            by_stage.setdefault(line.stage, []).append(line)
    return {name: _figures(mine, len(pairs), gpu_ms_per_step.get(name)) for name, mine in by_stage.items()}


def _figures(lines: list[WorkLine], num_pairs: int, gpu_ms: Optional[float]) -> WorkFigures:
    flops, num_bytes = sum(x.flops for x in lines) / num_pairs, sum(x.bytes for x in lines) / num_pairs
    if any(x.peak_flops_s is None or x.copy_bytes_s is None for x in lines):
        return WorkFigures(flops, num_bytes)
    memory_s = sum(x.bytes / x.copy_bytes_s for x in lines)
    compute_s = sum(x.flops / x.peak_flops_s for x in lines)
    roofline_ms = sum(x.roofline_s if x.roofline_s is not None else
                      work_roofline_s(x.flops, x.bytes, Rates(x.copy_bytes_s, x.peak_flops_s))
                      for x in lines) * 1e3 / num_pairs
    x_roofline = gpu_ms / roofline_ms if gpu_ms is not None and roofline_ms > 0 else None
    return WorkFigures(flops, num_bytes, roofline_ms, x_roofline, "memory" if memory_s >= compute_s else "compute")

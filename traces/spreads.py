"""Spreads of a report's stages: over its (rank, step) pairs (per-step mean, p50, idle) and over its ranks."""

from __future__ import annotations

import statistics
from dataclasses import replace

from instrumentation import stages as S
from traces.compute import StageInstance
from traces.records import StageRow, StepSpread

STEP_NAME = S.range_name(S.STEP)


def step_spreads(instances: list[StageInstance]) -> dict[str, StepSpread]:
    """Per stage: its totals per (rank, step) pair over every pair that has a step range."""
    pairs = sorted({(i.rank, i.step) for i in instances if i.name == STEP_NAME and i.step is not None})
    if not pairs:
        return {}
    cpu: dict[tuple, float] = {}
    gpu: dict[tuple, float] = {}
    idle: dict[tuple, float] = {}
    has_gpu = any(i.gpu_busy_us is not None for i in instances)
    for inst in instances:
        if inst.step is not None:
            key = (inst.name, inst.rank, inst.step)
            cpu[key] = cpu.get(key, 0.0) + inst.cpu_us / 1e3
            gpu[key] = gpu.get(key, 0.0) + (inst.gpu_busy_us or 0.0) / 1e3
            idle[key] = idle.get(key, 0.0) + (inst.gpu_idle_us or 0.0) / 1e3
    names = {k[0] for k in cpu}
    per_pair = lambda d, n: [d.get((n, *p), 0.0) for p in pairs]
    return {n: StepSpread.of(per_pair(cpu, n), per_pair(gpu, n) if has_gpu else None,
                             per_pair(idle, n) if has_gpu else None)
            for n in names}


def with_spreads(rows: list[StageRow], spreads: dict[str, StepSpread]) -> list[StageRow]:
    """``rows`` with their per-step spreads (None for a stage without)."""
    return [replace(r, per_step=spreads.get(r.name)) for r in rows]


def _spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def stragglers(report) -> None:
    """Per stage of a :class:`traces.report.Report`: the slowest rank and the spread of totals over ranks."""
    for row in report.stages:
        totals = {rank: r.cpu_ms.total for rank, rows in report.per_rank.items()
                  for r in rows if r.name == row.name}
        gpu_totals = [r.gpu_ms.total for rows in report.per_rank.values() for r in rows
                      if r.name == row.name and r.gpu_ms is not None]
        report.straggler[row.name] = max(totals, key=lambda k: (totals[k], -k))
        report.rank_spread[row.name] = {"cpu_total_ms": _spread(list(totals.values())),
                                        "gpu_total_ms": _spread(gpu_totals) if gpu_totals else None}

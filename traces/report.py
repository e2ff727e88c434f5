"""Aggregation of stage instances into report rows: merged, per rank, per step.

Definitions (see docs/traces.md): ``share`` of a stage is the CPU time of its ranges that lie inside
a step range, divided by the CPU time of the step ranges of the same scope; when the scope has no
step range, the stage's CPU time divided by the summed span of the scope's files. The straggler of a
stage is the rank with the largest CPU total for it.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from instrumentation import stages as S
from traces.compute import StageInstance, assign_steps, file_instances
from traces.load import LoadedSet
from traces.rows import StageRow, Stats

SCHEMA_VERSION = 1
STEP_NAME = S.range_name(S.STEP)
_ORDER = {S.range_name(s): i for i, s in enumerate(S.ALL_STAGES)}
_MIB = float(1 << 20)


@dataclass
class Report:
    """A full report: merged rows and, on request, per-rank and per-step rows."""

    sources: list[str]
    ranks: list[int]
    stages: list[StageRow]
    per_rank: dict[int, list[StageRow]] = field(default_factory=dict)
    per_step: dict[int, list[StageRow]] = field(default_factory=dict)
    straggler: dict[str, int] = field(default_factory=dict)
    rank_spread: dict[str, dict] = field(default_factory=dict)
    diff: list[dict] | None = None
    warnings: list[str] = field(default_factory=list)

    def to_dict(self, by_rank: bool = False, by_step: bool = False) -> dict:
        """The JSON document (``schema_version`` 1)."""
        out = {"schema_version": SCHEMA_VERSION, "sources": self.sources, "ranks": self.ranks,
               "stages": [r.to_dict() for r in self.stages]}
        if by_rank:
            out["per_rank"] = {str(k): [r.to_dict() for r in v] for k, v in self.per_rank.items()}
            out["straggler"] = self.straggler
            out["rank_spread"] = self.rank_spread
        if by_step:
            out["per_step"] = {str(k): [r.to_dict() for r in v] for k, v in self.per_step.items()}
        if self.diff is not None:
            out["diff"] = self.diff
        out["warnings"] = self.warnings
        return out


def stage_order(name: str) -> tuple:
    """Sort key: the stages of the contract in step order, then other names alphabetically."""
    return (_ORDER.get(name, len(_ORDER)), name)


def build_rows(instances: list[StageInstance], span_us: float, **row_fields) -> list[StageRow]:
    """One row per stage name of ``instances``; ``span_us`` is the share denominator without steps."""
    by_name: dict[str, list[StageInstance]] = {}
    for inst in instances:
        by_name.setdefault(inst.name, []).append(inst)
    step_total = sum(i.cpu_us for i in by_name.get(STEP_NAME, ()))
    rows = []
    for name in sorted(by_name, key=stage_order):
        group = by_name[name]
        if step_total > 0:
            inside = [i.cpu_us for i in group if i.step is not None]
            share = min(1.0, sum(inside) / step_total) if inside else None
        else:
            share = min(1.0, sum(i.cpu_us for i in group) / span_us) if span_us > 0 else None
        gpu = [i.gpu_busy_us / 1e3 for i in group if i.gpu_busy_us is not None]
        spans = [i.gpu_span_us for i in group if i.gpu_span_us is not None]
        alloc = [i.peak_allocated_bytes for i in group if i.peak_allocated_bytes is not None]
        reserved = [i.peak_reserved_bytes for i in group if i.peak_reserved_bytes is not None]
        rows.append(StageRow(
            name=name, count=len(group), cpu_ms=Stats.of(i.cpu_us / 1e3 for i in group),
            gpu_ms=Stats.of(gpu) if gpu else None,
            gpu_span_ms=sum(spans) / 1e3 if spans else None,
            self_ms=sum(i.self_us for i in group) / 1e3, share=share,
            peak_allocated_mib=max(alloc) / _MIB if alloc else None,
            peak_reserved_mib=max(reserved) / _MIB if reserved else None, **row_fields))
    return rows


def _spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def build_report(loaded: LoadedSet, prefix: str) -> Report:
    """Instances of every file, steps numbered per rank, and the rows of every scope."""
    instances: list[StageInstance] = []
    span_by_rank: dict[int, float] = {}
    for data in loaded.files:
        instances.extend(file_instances(data, data.rank, prefix))
        span_by_rank[data.rank] = span_by_rank.get(data.rank, 0.0) + data.span_us
    ranks = sorted(span_by_rank)
    by_rank: dict[int, list[StageInstance]] = {rank: [] for rank in ranks}
    for inst in instances:
        by_rank[inst.rank].append(inst)
    for rank in ranks:
        assign_steps(by_rank[rank], STEP_NAME)
    report = Report(sources=[d.path for d in loaded.files], ranks=ranks,
                    stages=build_rows(instances, sum(span_by_rank.values())),
                    warnings=list(loaded.warnings))
    for rank in ranks:
        rows = build_rows(by_rank[rank], span_by_rank[rank], rank=rank)
        if rows:
            report.per_rank[rank] = rows
    by_step: dict[int, list[StageInstance]] = {}
    for inst in instances:
        if inst.step is not None:
            by_step.setdefault(inst.step, []).append(inst)
    for k in sorted(by_step):
        report.per_step[k] = build_rows(by_step[k], 0.0, step=k)
    for row in report.stages:
        totals = {rank: r.cpu_ms.total for rank, rows in report.per_rank.items()
                  for r in rows if r.name == row.name}
        gpu_totals = [r.gpu_ms.total for rows in report.per_rank.values() for r in rows
                      if r.name == row.name and r.gpu_ms is not None]
        report.straggler[row.name] = max(totals, key=lambda k: (totals[k], -k))
        report.rank_spread[row.name] = {"cpu_total_ms": _spread(list(totals.values())),
                                        "gpu_total_ms": _spread(gpu_totals) if gpu_totals else None}
    return report

"""Aggregation of stage instances into a report: merged, per rank, per step, with headlines.

Definitions (see docs/traces.md): ``share`` of a stage is the CPU time of its ranges that lie inside
a step range, divided by the CPU time of the step ranges of the same scope; when the scope has no
step range, the stage's CPU time divided by the summed span of the scope's files. ``gpu_share`` is
the stage's GPU time over the root stage's (``opsd/step``, else the outermost stage), both unions of
GPU activity. The straggler of a stage is the rank with the largest CPU total for it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace

from instrumentation import stages as S
from traces.compute import StageInstance, assign_steps, file_instances, profiler_steps, step_problems
from traces.figures import GPU_FRACTION, HOST_FRACTION, bound, group_gpu, slowest_call, top_kernels
from traces.gpu import GpuOps
from traces.headline import Headline, headline
from traces.host import SyncWaits
from traces.load import LoadedSet
from traces.operators import SlowCall, host_cover, slow_calls, slow_operators
from traces.spreads import step_spreads, stragglers, with_spreads
from traces.records import GpuFigures, KernelRow, SlowOperator, StageRow, Stats
from traces.work import read_work, stage_work

SCHEMA_VERSION = 4
STEP_NAME = S.range_name(S.STEP)
_ORDER = {S.range_name(s): i for i, s in enumerate(S.ALL_STAGES)}
_MIB = float(1 << 20)


@dataclass
class Report:
    """A full report: merged rows and headline and, on request, per-rank and per-step ones."""

    sources: list[str]
    ranks: list[int]
    stages: list[StageRow]
    headline: Headline | None = None
    per_rank: dict[int, list[StageRow]] = field(default_factory=dict)
    rank_headline: dict[int, Headline] = field(default_factory=dict)
    per_step: dict[int, list[StageRow]] = field(default_factory=dict)
    #: (rank, step) -> rows of that rank in that step (TensorBoard scalars)
    per_rank_step: dict[tuple[int, int], list[StageRow]] = field(default_factory=dict)
    straggler: dict[str, int] = field(default_factory=dict)
    rank_spread: dict[str, dict] = field(default_factory=dict)
    diff: list[dict] | None = None
    warnings: list[str] = field(default_factory=list)
    #: Host operators with slow calls (:mod:`traces.operators`), largest excess first.
    operators: list[SlowOperator] = field(default_factory=list)
    #: Every kernel name (most GPU time first) of the stages findings may need (GPU-bound with work); of every stage
    #: with ``kernels`` > 0 (what ``--diff`` compares, :mod:`traces.kernel_diff`).
    stage_kernels: dict[str, tuple[KernelRow, ...]] = field(default_factory=dict)

    def to_dict(self, by_rank: bool = False, by_step: bool = False) -> dict:
        """The JSON document (``schema_version`` 4; the CLI adds ``findings``)."""
        out = {"schema_version": SCHEMA_VERSION, "sources": self.sources, "ranks": self.ranks,
               "headline": self.headline.to_dict() if self.headline else None,
               "stages": [r.to_dict() for r in self.stages],
               "slow_operators": [o.to_dict() for o in self.operators]}
        if by_rank:
            heads = {k: h.to_dict() for k, h in self.rank_headline.items()}
            out["per_rank"] = {str(k): {"headline": heads.get(k),
                                        "stages": [r.to_dict() for r in v]}
                               for k, v in self.per_rank.items()}
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


def root_name(instances: list[StageInstance]) -> str | None:
    """``opsd/step`` when present, else the outermost stage with the most CPU time."""
    names = {i.name for i in instances}
    if STEP_NAME in names:
        return STEP_NAME
    totals: dict[str, float] = {}
    for inst in instances:
        if inst.parent is None:
            totals[inst.name] = totals.get(inst.name, 0.0) + inst.cpu_us
    return max(totals, key=lambda n: (totals[n], n)) if totals else None


def _share(group: list[StageInstance], step_total: float, span_us: float) -> float | None:
    if step_total > 0:
        inside = [i.cpu_us for i in group if i.step is not None]
        return min(1.0, sum(inside) / step_total) if inside else None
    return min(1.0, sum(i.cpu_us for i in group) / span_us) if span_us > 0 else None


def _gpu_figures(group: list[StageInstance], root_busy: float | None) -> GpuFigures:
    if group[0].gpu_busy_us is None:
        return GpuFigures()
    g = group_gpu(group)
    idle = sum(i.gpu_idle_us or 0.0 for i in group)
    host_ops = [i.host_op_us for i in group if i.host_op_us is not None]
    host_op = sum(host_ops) if host_ops else None
    return GpuFigures(
        share=min(1.0, g.busy_us / root_busy) if root_busy else None,
        launches=sum(i.launches or 0 for i in group),
        sync_ms=sum(i.sync_us or 0.0 for i in group) / 1e3, wait_ms=g.wait_us / 1e3,
        bound=idle_bound(bound(g.busy_us, g.wait_us, g.window_us), idle, host_op, g.window_us),
        comm_ms=g.comm_us / 1e3,
        comm_overlap=min(1.0, g.overlap_us / g.comm_us) if g.comm_us > 0 else None,
        idle_ms=idle / 1e3, host_op_ms=host_op / 1e3 if host_op is not None else None)


def idle_bound(verdict: str, idle_us: float, host_op_us: float | None, window_us: float) -> str:
    """``idle`` for a ``host`` verdict when the device idles more than 60% of the window and the host runs
    operators less than 40% of it (neither side works: Python, I/O, or a wait outside the trace); else
    ``verdict``. Without operator events (older traces, nsys exports) never ``idle``."""
    if verdict != "host" or host_op_us is None or window_us <= 0:
        return verdict
    if idle_us > GPU_FRACTION * window_us and host_op_us < HOST_FRACTION * window_us:
        return "idle"
    return verdict


def _row(name: str, group: list[StageInstance], context: dict, row_fields: dict) -> StageRow:
    gpu = [i.gpu_busy_us / 1e3 for i in group if i.gpu_busy_us is not None]
    spans = [i.gpu_span_us for i in group if i.gpu_span_us is not None]
    alloc = [i.peak_allocated_bytes for i in group if i.peak_allocated_bytes is not None]
    reserved = [i.peak_reserved_bytes for i in group if i.peak_reserved_bytes is not None]
    parents = Counter(i.parent for i in group).most_common(1)[0][0]
    kernels, listed = context["kernels"], context["listed"]
    if kernels and name not in listed:  # every kernel of the stage, once: the report's stage_kernels reuse it
        listed[name] = top_kernels(group, 1 << 30)
    return StageRow(
        name=name, count=len(group), cpu_ms=Stats.of(i.cpu_us / 1e3 for i in group),
        gpu_ms=Stats.of(gpu) if gpu else None, gpu_span_ms=sum(spans) / 1e3 if spans else None,
        self_ms=sum(i.self_us for i in group) / 1e3,
        share=_share(group, context["step_total"], context["span_us"]),
        peak_allocated_mib=max(alloc) / _MIB if alloc else None,
        peak_reserved_mib=max(reserved) / _MIB if reserved else None,
        gpu=_gpu_figures(group, context["root_busy"]), parent=parents,
        kernels=listed[name][:kernels] if kernels else None,
        slowest=slowest_call(group) if kernels else None, **row_fields)


def tree_order(rows: list[StageRow]) -> list[StageRow]:
    """Rows depth first along their parents (children in stage order), with ``depth`` set."""
    by_name = {r.name: r for r in rows}
    children: dict[str | None, list[str]] = {}
    for r in rows:
        parent = r.parent if r.parent in by_name and r.parent != r.name else None
        children.setdefault(parent, []).append(r.name)
    out: list[StageRow] = []
    stack = [(n, 0) for n in sorted(children.get(None, []), key=stage_order, reverse=True)]
    while stack:
        name, depth = stack.pop()
        out.append(replace(by_name[name], depth=depth))
        stack += [(n, depth + 1) for n in sorted(children.get(name, []), key=stage_order, reverse=True)]
    seen = {r.name for r in out}  # names in a parent cycle: append flat
    return out + [r for r in sorted(rows, key=lambda r: stage_order(r.name)) if r.name not in seen]


def build_rows(instances: list[StageInstance], span_us: float, kernels: int = 0, listed: dict | None = None,
               **row_fields) -> list[StageRow]:
    """One row per stage name of ``instances``, in tree order; ``span_us`` is the share denominator
    without steps; ``kernels`` > 0 adds the top kernels and the slowest call, from ``listed`` (stage name -> every
    kernel of its instances here, filled where missing) when given."""
    by_name: dict[str, list[StageInstance]] = {}
    for inst in instances:
        by_name.setdefault(inst.name, []).append(inst)
    root = root_name(instances)
    root_busy = None
    if root is not None and by_name[root][0].gpu_busy_us is not None:
        root_busy = group_gpu(by_name[root]).busy_us
    context = {"step_total": sum(i.cpu_us for i in by_name.get(STEP_NAME, ())), "span_us": span_us,
               "root_busy": root_busy, "kernels": kernels, "listed": {} if listed is None else listed}
    rows = [_row(name, by_name[name], context, row_fields) for name in by_name]
    return tree_order(rows)


@dataclass
class _File:
    """One file's data with its GPU index, host waits, stage instances and slow operator calls."""

    data: object
    gpu: GpuOps
    waits: SyncWaits
    instances: list[StageInstance]
    slow: list[SlowCall]


def _read(loaded: LoadedSet, prefix: str) -> list[_File]:
    out = []
    for data in loaded.files:
        gpu = GpuOps(data)
        waits = SyncWaits(data, gpu)
        instances = file_instances(data, data.rank, prefix, gpu, waits)
        cover = host_cover(data.ops) if len(data.ops) else None
        for inst in instances:
            if gpu.available:
                inst.gpu_idle_us = gpu.idle_between(inst.start_us, inst.end_us)
            if cover is not None:
                c = cover.get(inst.pid)
                inst.host_op_us = c.between(inst.start_us, inst.end_us) if c is not None else 0.0
        out.append(_File(data, gpu, waits, instances, slow_calls(data.ops, gpu, waits)))
    return out


def _rank_headline(files: list[_File]) -> Headline | None:
    instances = [i for f in files for i in f.instances]
    root = root_name(instances)
    if root is None:
        return None
    windows = [(f.gpu, f.waits, i.pid, i.start_us, i.end_us) for f in files for i in f.instances
               if i.name == root and i.parent != root]
    return headline(root, windows, any(f.gpu.available for f in files))


def _with_work(rows: list[StageRow], instances: list[StageInstance], report: Report) -> list[StageRow]:
    """``rows`` with the work of the run's sidecars (:mod:`traces.work`) over its steps; unchanged without."""
    pairs = {(i.rank, i.step) for i in instances if i.name == STEP_NAME and i.step is not None}
    lines = read_work(report.sources, report.warnings) if pairs else []
    if not lines:
        return rows
    gpu = {r.name: r.per_step.gpu_mean_ms for r in rows if r.per_step is not None}
    work = stage_work(lines, pairs, gpu)
    return [work_bound(replace(r, work=work.get(r.name))) for r in rows]


def work_bound(row: StageRow) -> StageRow:
    """A ``gpu`` verdict refined to its work's limit (``memory`` or ``compute``) when the row has one."""
    if row.gpu.bound == "gpu" and row.work is not None and row.work.limit is not None:
        return replace(row, gpu=replace(row.gpu, bound=row.work.limit))
    return row


def build_report(loaded: LoadedSet, prefix: str, kernels: int = 0, steps: bool = True) -> Report:
    """Instances of every file, steps numbered per rank, and the rows of every scope (the per-step
    scopes only when ``steps``: they cost a pass per step)."""
    files = _read(loaded, prefix)
    ranks = sorted({f.data.rank for f in files})
    by_rank = {rank: [f for f in files if f.data.rank == rank] for rank in ranks}
    instances = [i for f in files for i in f.instances]
    notes = []
    for rank, mine in by_rank.items():
        marks = [m for f in mine for m in profiler_steps(f.data)]
        assign_steps([i for f in mine for i in f.instances], STEP_NAME, marks)
        notes += step_problems([i for f in mine for i in f.instances], STEP_NAME, rank)
    span = {rank: sum(f.data.span_us for f in mine) for rank, mine in by_rank.items()}
    listed: dict[str, tuple[KernelRow, ...]] = {}  # each stage's kernels, scanned once for its rows and stage_kernels
    rows = build_rows(instances, sum(span.values()), kernels, listed)
    report = Report(sources=[f.data.path for f in files], ranks=ranks,
                    stages=with_spreads(rows, step_spreads(instances)),
                    warnings=list(loaded.warnings) + notes)
    report.stages = _with_work(report.stages, instances, report)
    report.operators = slow_operators([(f.slow, f.instances, f.data.ops) for f in files])
    report.stage_kernels = _stage_kernels(report.stages, instances, listed, every=kernels > 0)
    for rank, mine in by_rank.items():
        rank_instances = [i for f in mine for i in f.instances]
        rank_rows = build_rows(rank_instances, span[rank], kernels, listed if len(ranks) == 1 else None, rank=rank)
        if rank_rows:
            report.per_rank[rank] = with_spreads(rank_rows, step_spreads(rank_instances))
        head = _rank_headline(mine)
        if head is not None:
            report.rank_headline[rank] = head
    report.headline = Headline.total(list(report.rank_headline.values()))
    if steps:
        _per_step(report, instances)
    stragglers(report)
    return report


def _per_step(report: Report, instances: list[StageInstance]) -> None:
    by_step: dict[int, list[StageInstance]] = {}
    by_rank_step: dict[tuple[int, int], list[StageInstance]] = {}
    for inst in instances:
        if inst.step is not None:
            by_step.setdefault(inst.step, []).append(inst)
            by_rank_step.setdefault((inst.rank, inst.step), []).append(inst)
    for k in sorted(by_step):
        report.per_step[k] = with_spreads(build_rows(by_step[k], 0.0, step=k), step_spreads(by_step[k]))
    for (rank, k) in sorted(by_rank_step):
        report.per_rank_step[(rank, k)] = build_rows(by_rank_step[(rank, k)], 0.0, rank=rank, step=k)


def _stage_kernels(rows: list[StageRow], instances: list[StageInstance], listed: dict,
                   every: bool = False) -> dict[str, tuple[KernelRow, ...]]:
    """Every kernel name (most GPU time first) of the rows the findings set against their roofline (``every``: of
    every row); ``listed``'s lists where it has them."""
    wanted = {r.name for r in rows if every or r.work is not None and r.work.roofline_ms and r.gpu.bound in
              ("gpu", "memory", "compute")}
    return {name: listed[name] if name in listed else top_kernels([i for i in instances if i.name == name], 1 << 30)
            for name in wanted}

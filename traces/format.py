"""Text forms of a report's rows: the overview tree, the details table, kernels, headlines, CSV.

Every table is rendered by :func:`traces.table.render` (one style). Stage names are indented by
their depth in the stage tree (two spaces per level in text, ``&emsp;`` in Markdown).
"""

from __future__ import annotations

import os
import re

from traces.headline import Headline
from traces.names import shown
from traces.records import StageRow
from instrumentation.table import FORMATS, Column, fixed, percent, render

_STATS = ("total", "mean", "p50", "p90", "max")
_MS, _MIB, _PCT = fixed(3), fixed(1), percent(1)
_INDENT = {"table": "  ", "markdown": "&emsp;", "csv": ""}


def _label(row: StageRow, fmt: str) -> str:
    """The indented name of a text table (cut to :data:`traces.names.MAX_SHOWN_CHARS`; CSV keeps it whole)."""
    return _INDENT[fmt] * row.depth + (row.name if fmt == "csv" else shown(row.name))


def _check(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {', '.join(FORMATS)}; got {fmt!r}")


def _scope_columns(rows: list[StageRow]) -> list[Column]:
    cols = [Column("rank", "rank")] if any(r.rank is not None for r in rows) else []
    return cols + ([Column("step", "step")] if any(r.step is not None for r in rows) else [])


def _scope_values(row: StageRow, columns: list[Column]) -> list:
    return [getattr(row, c.key) for c in columns]


def format_overview(rows: list[StageRow], fmt: str = "table") -> str:
    """The stage tree with CPU and GPU time and shares, GPU idle, launches, sync waits and the verdict: per step
    (the mean over the recorded steps, and the median step when there are several) where the rows have step
    figures, else totals over the trace."""
    _check(fmt)
    scope = _scope_columns(rows)
    comm = any(r.gpu.comm_ms for r in rows)
    stepped = any(r.per_step is not None for r in rows)
    p50 = stepped and any(r.per_step is not None and r.per_step.n > 1 for r in rows)
    columns = scope + [Column("name", "stage", left=True), Column("count", "count"), Column("cpu_ms", "cpu ms", _MS)]
    columns += [Column("cpu_p50", "cpu p50", _MS)] if p50 else []
    columns += [Column("share", "cpu share", _PCT), Column("gpu_ms", "gpu ms", _MS)]
    columns += [Column("gpu_p50", "gpu p50", _MS)] if p50 else []
    columns += [Column("gpu_share", "gpu share", _PCT), Column("idle_ms", "idle ms", _MS),
                Column("launches", "launches", _launches if stepped else str),
                Column("sync_ms", "sync ms", _MS), Column("bound", "bound", left=True)]
    if comm:
        columns += [Column("comm_ms", "comm ms", _MS), Column("comm_overlap", "comm overlap", _PCT)]
    columns.append(Column("peak_allocated_mib", "peak MiB", _MIB))
    if any(r.work is not None for r in rows):  # the roofline's columns only where rates were known
        roofline = any(r.work is not None and r.work.roofline_ms is not None for r in rows)
        columns += WORK_COLUMNS if roofline else WORK_COLUMNS[:2]
    out = []
    for r in rows:
        values = {"name": _label(r, fmt), "count": r.count, "share": r.share, "gpu_share": r.gpu.share,
                  "bound": r.gpu.bound, "comm_overlap": r.gpu.comm_overlap,
                  "peak_allocated_mib": r.peak_allocated_mib, **_time_values(r, stepped), **work_values(r)}
        out.append(_scope_values(r, scope) + [values[c.key] for c in columns[len(scope):]])
    return render(columns, out, fmt, _overview_title(rows, stepped, p50) if fmt != "csv" else None)


def _overview_title(rows: list[StageRow], stepped: bool, p50: bool) -> str:
    if not stepped:
        return "stages (totals over the trace: it has no step ranges; count: ranges in all)"
    n = max(r.per_step.n for r in rows if r.per_step is not None)
    median = "; cpu/gpu p50: the median step" if p50 else ""
    return f"stages (ms, launches per step: mean over {n:,} recorded step{'s' if n != 1 else ''}{median}; count: ranges in all)"


def _launches(value) -> str:
    """Launches per step: whole numbers as such, fractions (an average over steps) with one decimal."""
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.1f}"


def _time_values(row: StageRow, stepped: bool) -> dict:
    """The overview's times of ``row``: per step (its :class:`StepSpread`; totals over its steps for the counts
    and waits) when ``stepped``, else totals; None where it has none."""
    g, spread = row.gpu, row.per_step
    if not stepped:
        return {"cpu_ms": row.cpu_ms.total, "gpu_ms": row.gpu_ms.total if row.gpu_ms else None,
                "idle_ms": g.idle_ms, "launches": g.launches, "sync_ms": g.sync_ms, "comm_ms": g.comm_ms}
    if spread is None:
        return dict.fromkeys(("cpu_ms", "cpu_p50", "gpu_ms", "gpu_p50", "idle_ms", "launches", "sync_ms", "comm_ms"))
    per = lambda v: v / spread.n if v is not None else None
    return {"cpu_ms": spread.cpu_mean_ms, "cpu_p50": spread.cpu_p50_ms, "gpu_ms": spread.gpu_mean_ms,
            "gpu_p50": spread.gpu_p50_ms, "idle_ms": spread.idle_mean_ms, "launches": per(g.launches),
            "sync_ms": per(g.sync_ms), "comm_ms": per(g.comm_ms)}


#: The overview's work columns (runs with a work sidecar): per step, :class:`traces.work.WorkFigures`.
WORK_COLUMNS = [Column("work_gflop", "GFLOP/step", _MS), Column("work_mb", "MB/step", _MS),
                Column("roofline_ms", "roofline ms/step", _MS), Column("x_roofline", "× roofline", fixed(2)),
                Column("limit", "limit", left=True)]


def work_values(row: StageRow) -> dict:
    """The work columns' values of ``row`` (all None without work)."""
    w = row.work
    if w is None:
        return dict.fromkeys(("work_gflop", "work_mb", "roofline_ms", "x_roofline", "limit"))
    return {"work_gflop": w.flops / 1e9, "work_mb": w.bytes / 1e6, "roofline_ms": w.roofline_ms,
            "x_roofline": w.x_roofline, "limit": w.limit}


def _detail_columns(rows: list[StageRow]) -> list[Column]:
    cols = _scope_columns(rows) + [Column("name", "stage", left=True), Column("count", "count")]
    cols += [Column(f"cpu_{k}_ms", "cpu total" if k == "total" else k, _MS) for k in _STATS]
    return cols + [Column("gpu_total_ms", "gpu total", _MS), Column("gpu_span_ms", "gpu span", _MS),
                   Column("self_ms", "self", _MS), Column("share", "share", _PCT),
                   Column("peak_allocated_mib", "peak alloc MiB", _MIB),
                   Column("peak_reserved_mib", "peak rsv MiB", _MIB)]


def _flat(row: StageRow, fmt: str = "csv") -> dict:
    """Every scalar of a row by column key (``name`` indented for text formats)."""
    d = {"rank": row.rank, "step": row.step, "name": _label(row, fmt) if fmt != "csv" else row.name,
         "parent": row.parent, "count": row.count}
    for prefix, stats in (("cpu", row.cpu_ms), ("gpu", row.gpu_ms)):
        for key in _STATS:
            d[f"{prefix}_{key}_ms"] = getattr(stats, key) if stats else None
    d.update(gpu_span_ms=row.gpu_span_ms, self_ms=row.self_ms, share=row.share,
             peak_allocated_mib=row.peak_allocated_mib, peak_reserved_mib=row.peak_reserved_mib)
    d.update(row.gpu.to_dict())
    spread = row.per_step
    d.update({f"step_{k}": getattr(spread, k) if spread else None
              for k in ("n", "cpu_mean_ms", "cpu_sd_ms", "gpu_mean_ms", "gpu_sd_ms", "cpu_p50_ms", "gpu_p50_ms",
                        "idle_mean_ms")})
    return d


#: CSV columns: every scalar of a row (docs/traces.md lists them).
CSV_KEYS = ("rank", "step", "name", "parent", "count", *(f"{p}_{k}_ms" for p in ("cpu", "gpu") for k in _STATS),
            "gpu_span_ms", "self_ms", "share", "gpu_share", "launches", "sync_ms", "wait_ms", "bound",
            "comm_ms", "comm_overlap", "idle_ms", "host_op_ms", "peak_allocated_mib", "peak_reserved_mib", "step_n",
            "step_cpu_mean_ms", "step_cpu_sd_ms", "step_gpu_mean_ms", "step_gpu_sd_ms", "step_cpu_p50_ms",
            "step_gpu_p50_ms", "step_idle_mean_ms")


#: CSV columns added when a row has work (a run with a work sidecar).
CSV_WORK_KEYS = ("work_flops", "work_bytes", "roofline_ms", "x_roofline", "limit")


def csv_rows(rows: list[StageRow]) -> tuple[list[Column], list[list]]:
    """Columns and values of the CSV form of ``rows`` (one line per row)."""
    keys = CSV_KEYS + (CSV_WORK_KEYS if any(r.work is not None for r in rows) else ())
    flat = lambda r: {**_flat(r), **({} if r.work is None else {"work_flops": r.work.flops, "work_bytes": r.work.bytes,
                                                                 "roofline_ms": r.work.roofline_ms,
                                                                 "x_roofline": r.work.x_roofline,
                                                                 "limit": r.work.limit})}
    return [Column(k, k) for k in keys], [[flat(r).get(k) for k in keys] for r in rows]


def format_table(rows: list[StageRow], fmt: str = "table") -> str:
    """``rows`` as the details table (percentiles, self time, span, peaks) or, in CSV, every field."""
    _check(fmt)
    if fmt == "csv":
        return render(*csv_rows(rows), "csv")
    columns = _detail_columns(rows)
    return render(columns, [[_flat(r, fmt)[c.key] for c in columns] for r in rows], fmt)


_QUALIFIER = re.compile(r"(?:\(anonymous namespace\)|[A-Za-z_]\w*)::")


def readable_kernel(name: str) -> str:
    """A kernel's name without ``void`` and namespace qualifiers (``at::native::``, ``(anonymous namespace)::``)."""
    return _QUALIFIER.sub("", name[5:] if name.startswith("void ") else name)


def short_kernel_names(names: list[str], width: int) -> list[str]:
    """``names`` readable (:func:`readable_kernel`) and at most ``width`` characters, still telling apart names
    that a plain cut would make identical: such a name keeps its head, then skips the part it shares with the
    others and shows what follows (``multi_tensor_apply_kernel<…FusedAdamMathFunctor<float, 4…``)."""
    readable = [readable_kernel(n) for n in names]
    out = []
    for i, name in enumerate(readable):
        if len(name) <= width:
            out.append(name)
            continue
        stem = name[:width - 1]
        peers = [m for j, m in enumerate(readable) if j != i and m != name and m[:width - 1] == stem]
        if not peers:
            out.append(stem + "…")
            continue
        common = min(len(os.path.commonprefix([name, m])) for m in peers)
        head = name[:width // 3]
        rest = width - len(head) - 2
        tail = name[common:common + rest]
        out.append(head + "…" + tail + ("…" if common + rest < len(name) else ""))
    return out


def format_kernels(rows: list[StageRow], fmt: str = "table", width: int = 90) -> str:
    """Per stage: its top kernels (name, calls, summed GPU ms, that over the stage's GPU time) and the
    start of its slowest call (``ts`` in the file, and ms after the file's first event)."""
    _check(fmt)
    columns = [Column("stage", "stage", left=True), Column("kernel", "kernel / slowest call", left=True),
               Column("count", "count"), Column("gpu_ms", "gpu ms", _MS),
               Column("part", "of stage gpu", _PCT)]
    out = []
    every = [k.name for r in rows for k in r.kernels or ()]
    short = dict(zip(every, every if fmt == "csv" else short_kernel_names(every, width)))
    for r in rows:
        if not r.kernels and r.slowest is None:
            continue
        total = r.gpu_ms.total if r.gpu_ms else None
        label = r.name
        for k in r.kernels or ():
            out.append([label, short[k.name], k.count, k.gpu_ms, k.gpu_ms / total if total else None])
            label = ""
        if r.slowest is not None:
            s = r.slowest
            out.append([label, f"slowest: ts {s.ts_us:.3f} us (+{s.offset_ms:.3f} ms), "
                               f"window {s.window_ms:.3f} ms, rank {s.rank}", None, None, None])
    return render(columns, out, fmt)


def _ms(value: float) -> str:
    return f"{value:,.1f}" if abs(value) >= 10 else f"{value:.3f}"


def format_headline(head: Headline | None, label: str = "") -> str:
    """One line: wall time, GPU busy and where the idle time went (ms; per step when the root stage has several
    ranges, with the wall time in all)."""
    if head is None:
        return f"{label}no root stage\n"
    n = head.num_ranges
    ranges = f"{n} range{'s' if n != 1 else ''}"
    if n > 1:  # several steps: per step (the totals are in the JSON report), not a sum that reads like one step
        unit = "step" if head.stage.endswith("/step") else "range"
        per = lambda ms: _ms(ms / n)
        text = f"{label}{head.stage} ({ranges}): wall {per(head.wall_ms)} ms/{unit} ({_ms(head.wall_ms)} in all)"
    else:
        unit, per = None, _ms
        text = f"{label}{head.stage} ({ranges}): wall {_ms(head.wall_ms)} ms"
    if head.gpu_busy_ms is None:
        return text + ", no GPU activity in the trace\n"
    i = head.idle
    idle = i.host_launch_ms + i.host_sync_ms + i.other_ms
    return (text + f", GPU busy {per(head.gpu_busy_ms)} ({head.gpu_busy_pct:.1f}%), GPU idle {per(idle)}: "
            f"host launching {per(i.host_launch_ms)}, host in syncs {per(i.host_sync_ms)}, "
            f"queued/other {per(i.other_ms)}" + (f" (ms/{unit})" if unit else "") + "\n")

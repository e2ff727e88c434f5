"""Report rows and their text formats, independent of trace parsing.

:class:`StageRow` is the one row type of every per-stage table of the project: the trace report,
the demo's live-timer table and the benchmarks build rows with :meth:`StageRow.from_samples` and
print them with :func:`format_table`.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass

FORMATS = ("table", "markdown", "csv")


def percentile(sorted_values: list[float], q: float) -> float:
    """The ``q``-quantile (0-1) of ascending values, linear between closest ranks (numpy's default)."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1]; got {q}")
    pos = (len(sorted_values) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


@dataclass(frozen=True)
class Stats:
    """Summary of a list of durations in milliseconds."""

    total: float
    mean: float
    p50: float
    p90: float
    max: float

    @classmethod
    def of(cls, values_ms) -> "Stats":
        """Stats of ``values_ms`` (at least one value)."""
        values = sorted(float(v) for v in values_ms)
        if not values:
            raise ValueError("values_ms must not be empty")
        total = math.fsum(values)
        return cls(total, total / len(values), percentile(values, 0.5), percentile(values, 0.9),
                   values[-1])

    def to_dict(self) -> dict:
        return {"total": self.total, "mean": self.mean, "p50": self.p50, "p90": self.p90,
                "max": self.max}


@dataclass(frozen=True)
class StageRow:
    """Figures of one stage (merged, or of one rank / one step when ``rank`` / ``step`` is set)."""

    #: Full range name, e.g. ``"opsd/prefill"``.
    name: str
    #: Number of ranges.
    count: int
    #: CPU (wall) duration of the ranges.
    cpu_ms: Stats
    #: GPU busy time projected onto the ranges; None when no GPU activity was recorded.
    gpu_ms: Stats | None = None
    #: Sum over ranges of first GPU start to last GPU end; None without GPU activity.
    gpu_span_ms: float | None = None
    #: CPU time minus nested stages, summed over ranges.
    self_ms: float | None = None
    #: Fraction (0-1) of the enclosing step time (of the trace span when there is no step).
    share: float | None = None
    #: Peak allocator memory inside the ranges; None when the trace has no memory samples.
    peak_allocated_mib: float | None = None
    peak_reserved_mib: float | None = None
    #: The rank of a per-rank row.
    rank: int | None = None
    #: The step of a per-step row.
    step: int | None = None

    def __post_init__(self):
        if self.count < 0:
            raise ValueError(f"count must be >= 0; got {self.count}")
        if self.share is not None and not 0.0 <= self.share <= 1.0 + 1e-9:
            raise ValueError(f"share must be in [0, 1]; got {self.share}")

    @classmethod
    def from_samples(cls, name: str, cpu_ms, gpu_ms=None, **kwargs) -> "StageRow":
        """A row from per-range durations (e.g. a live timer's); ``kwargs`` set the other fields."""
        cpu = list(cpu_ms)
        return cls(name=name, count=len(cpu), cpu_ms=Stats.of(cpu),
                   gpu_ms=Stats.of(gpu_ms) if gpu_ms is not None else None, **kwargs)

    def to_dict(self) -> dict:
        """The row in the JSON schema (``rank`` / ``step`` are keys of the enclosing object)."""
        return {"name": self.name, "count": self.count, "cpu_ms": self.cpu_ms.to_dict(),
                "gpu_ms": self.gpu_ms.to_dict() if self.gpu_ms else None,
                "gpu_span_ms": self.gpu_span_ms, "self_ms": self.self_ms, "share": self.share,
                "peak_allocated_mib": self.peak_allocated_mib,
                "peak_reserved_mib": self.peak_reserved_mib}


_CSV_FIELDS = ("rank", "step", "name", "count", "cpu_total_ms", "cpu_mean_ms", "cpu_p50_ms",
               "cpu_p90_ms", "cpu_max_ms", "gpu_total_ms", "gpu_mean_ms", "gpu_p50_ms",
               "gpu_p90_ms", "gpu_max_ms", "gpu_span_ms", "self_ms", "share",
               "peak_allocated_mib", "peak_reserved_mib")


def _flat(row: StageRow) -> dict:
    d = {"rank": row.rank, "step": row.step, "name": row.name, "count": row.count}
    for prefix, stats in (("cpu", row.cpu_ms), ("gpu", row.gpu_ms)):
        for key in ("total", "mean", "p50", "p90", "max"):
            d[f"{prefix}_{key}_ms"] = getattr(stats, key) if stats else None
    d.update(gpu_span_ms=row.gpu_span_ms, self_ms=row.self_ms, share=row.share,
             peak_allocated_mib=row.peak_allocated_mib, peak_reserved_mib=row.peak_reserved_mib)
    return d


def _cell(value, decimals: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{decimals}f}"
    return str(value)


def _text_columns(rows: list[StageRow]) -> tuple[list[str], list[list[str]]]:
    head = ["stage", "count", "cpu total", "mean", "p50", "p90", "max", "gpu total", "gpu span",
            "self", "share", "peak alloc MiB", "peak rsv MiB"]
    extra = [("rank", "rank")] if any(r.rank is not None for r in rows) else []
    extra += [("step", "step")] if any(r.step is not None for r in rows) else []
    cells = []
    for r in rows:
        c = [r.name, str(r.count)] + [_cell(getattr(r.cpu_ms, k)) for k in
                                      ("total", "mean", "p50", "p90", "max")]
        c += [_cell(r.gpu_ms.total if r.gpu_ms else None), _cell(r.gpu_span_ms),
              _cell(r.self_ms), "-" if r.share is None else f"{100 * r.share:.1f}%",
              _cell(r.peak_allocated_mib, 1), _cell(r.peak_reserved_mib, 1)]
        cells.append([_cell(getattr(r, attr)) for _, attr in extra] + c)
    return [h for h, _ in extra] + head, cells


def format_table(rows: list[StageRow], fmt: str = "table") -> str:
    """``rows`` as an aligned text table (ms), a Markdown table, or CSV (``FORMATS``)."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {', '.join(FORMATS)}; got {fmt!r}")
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=_CSV_FIELDS, lineterminator="\n")
        writer.writeheader()
        for r in rows:
            writer.writerow({k: ("" if v is None else v) for k, v in _flat(r).items()})
        return out.getvalue()
    head, cells = _text_columns(rows)
    if fmt == "markdown":
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join(
            " --- " if head[i] == "stage" else " ---: "
            for i in range(len(head))) + "|"]
        lines += ["| " + " | ".join(c) + " |" for c in cells]
        return "\n".join(lines) + "\n"
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h)
              for i, h in enumerate(head)]
    name_col = head.index("stage")
    fmt_row = lambda c: "  ".join(x.ljust(w) if i == name_col else x.rjust(w)
                                  for i, (x, w) in enumerate(zip(c, widths)))
    lines = [fmt_row(head), "  ".join("-" * w for w in widths)] + [fmt_row(c) for c in cells]
    return "\n".join(lines) + "\n"

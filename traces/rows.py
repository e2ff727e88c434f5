"""Report rows and their text formats, independent of trace parsing.

:class:`StageRow` is the one row type of every per-stage table of the project: the trace report,
the demo's live-timer table and the benchmarks build rows with :meth:`StageRow.from_samples` and
print them with :func:`format_table`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from traces.table import FORMATS, Column, fixed, percent, render


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


_STATS = ("total", "mean", "p50", "p90", "max")
_MS, _MIB = fixed(3), fixed(1)


def _csv_columns() -> list[Column]:
    cols = [Column("rank", "rank"), Column("step", "step"), Column("name", "stage"),
            Column("count", "count")]
    cols += [Column(f"{side}_{k}_ms", f"{side} {k}") for side in ("cpu", "gpu") for k in _STATS]
    return cols + [Column(k, k) for k in ("gpu_span_ms", "self_ms", "share", "peak_allocated_mib",
                                          "peak_reserved_mib")]


def _csv_values(row: StageRow) -> list:
    values = [row.rank, row.step, row.name, row.count]
    for stats in (row.cpu_ms, row.gpu_ms):
        values += [getattr(stats, k) if stats else None for k in _STATS]
    return values + [row.gpu_span_ms, row.self_ms, row.share, row.peak_allocated_mib,
                     row.peak_reserved_mib]


def _text_columns(rows: list[StageRow]) -> list[Column]:
    cols = [Column("rank", "rank")] if any(r.rank is not None for r in rows) else []
    cols += [Column("step", "step")] if any(r.step is not None for r in rows) else []
    cols += [Column("name", "stage", left=True), Column("count", "count")]
    cols += [Column(f"cpu_{k}_ms", "cpu total" if k == "total" else k, _MS) for k in _STATS]
    return cols + [Column("gpu_total_ms", "gpu total", _MS), Column("gpu_span_ms", "gpu span", _MS),
                   Column("self_ms", "self", _MS), Column("share", "share", percent(1)),
                   Column("peak_allocated_mib", "peak alloc MiB", _MIB),
                   Column("peak_reserved_mib", "peak rsv MiB", _MIB)]


def _text_values(row: StageRow, columns: list[Column]) -> list:
    values = {"rank": row.rank, "step": row.step, "name": row.name, "count": row.count,
              "gpu_total_ms": row.gpu_ms.total if row.gpu_ms else None,
              "gpu_span_ms": row.gpu_span_ms, "self_ms": row.self_ms, "share": row.share,
              "peak_allocated_mib": row.peak_allocated_mib, "peak_reserved_mib": row.peak_reserved_mib}
    values.update({f"cpu_{k}_ms": getattr(row.cpu_ms, k) for k in _STATS})
    return [values[c.key] for c in columns]


def format_table(rows: list[StageRow], fmt: str = "table") -> str:
    """``rows`` as an aligned text table (ms), a Markdown table, or CSV (``FORMATS``)."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {', '.join(FORMATS)}; got {fmt!r}")
    if fmt == "csv":
        return render(_csv_columns(), [_csv_values(r) for r in rows], "csv")
    columns = _text_columns(rows)
    return render(columns, [_text_values(r, columns) for r in rows], fmt)

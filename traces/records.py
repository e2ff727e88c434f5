"""Report rows: one record per stage (and per rank / step), independent of trace parsing.

:class:`StageRow` is the one row type of every per-stage table of the project: the trace report,
the demo's live-timer table and the benchmarks build rows with :meth:`StageRow.from_samples` and
print them with :func:`traces.format.format_table`. Rows serialise to the JSON schema of
``docs/traces.md`` (:meth:`StageRow.to_dict`) and back (:func:`traces.saved.row_from_dict`, which
also reads schema version 1). Their public import path is :mod:`traces.rows`, which also names the table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from traces.work import WorkFigures

#: Verdicts of a stage (docs/traces.md, *Verdict*): ``memory`` / ``compute`` refine ``gpu`` where the stage's work is
#: known; ``idle`` is a ``host`` stage whose host runs no operator most of the time either.
BOUNDS = ("host", "gpu", "sync", "mixed", "memory", "compute", "idle")


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
class StepSpread:
    """A stage's totals per recorded step (per rank and step), for before/after noise guards."""

    n: int
    """Number of (rank, step) pairs (a pair where the stage did not run counts as 0 ms)."""
    cpu_mean_ms: float
    cpu_sd_ms: float | None
    """Sample standard deviation over the pairs (None for a single pair)."""
    gpu_mean_ms: float | None = None
    gpu_sd_ms: float | None = None
    cpu_p50_ms: float | None = None
    """Median over the pairs (the middle step); None in reports of schema < 4."""
    gpu_p50_ms: float | None = None
    idle_mean_ms: float | None = None
    """GPU idle inside its ranges per pair (:attr:`GpuFigures.idle_ms`); None without GPU activity."""

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"n must be >= 1; got {self.n}")

    @classmethod
    def of(cls, cpu_ms: list[float], gpu_ms: list[float] | None, idle_ms: list[float] | None = None) -> "StepSpread":
        """From per-pair totals (``gpu_ms`` / ``idle_ms`` None on a CPU trace)."""
        mean_sd = lambda v: (math.fsum(v) / len(v), _sd(v))
        gpu = mean_sd(gpu_ms) if gpu_ms else (None, None)
        p50 = lambda v: percentile(sorted(v), 0.5) if v else None
        idle = math.fsum(idle_ms) / len(idle_ms) if idle_ms else None
        return cls(len(cpu_ms), *mean_sd(cpu_ms), *gpu, p50(cpu_ms), p50(gpu_ms), idle)

    def to_dict(self) -> dict:
        return {"n": self.n, "cpu_mean_ms": self.cpu_mean_ms, "cpu_sd_ms": self.cpu_sd_ms,
                "gpu_mean_ms": self.gpu_mean_ms, "gpu_sd_ms": self.gpu_sd_ms, "cpu_p50_ms": self.cpu_p50_ms,
                "gpu_p50_ms": self.gpu_p50_ms, "idle_mean_ms": self.idle_mean_ms}


def _sd(values: list[float]) -> float | None:
    if len(values) < 2:
        return None
    mean = math.fsum(values) / len(values)
    return math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1))


@dataclass(frozen=True)
class KernelRow:
    """One kernel (or copy) name of a stage: calls and summed GPU time."""

    name: str
    count: int
    gpu_ms: float

    def to_dict(self) -> dict:
        return {"name": self.name, "count": self.count, "gpu_ms": self.gpu_ms}


@dataclass(frozen=True)
class SlowestCall:
    """The instance of a stage with the longest window (CPU start to end of its last GPU work)."""

    ts_us: float
    """Start on the trace's own clock (the ``ts`` of the range in the file)."""
    offset_ms: float
    """Start after the first event of its file (what a trace viewer's time axis shows)."""
    window_ms: float
    path: str
    rank: int

    def to_dict(self) -> dict:
        return {"ts_us": self.ts_us, "offset_ms": self.offset_ms, "window_ms": self.window_ms,
                "file": self.path, "rank": self.rank}


@dataclass(frozen=True)
class GpuFigures:
    """What a stage did on and for the GPU (all None on a trace without GPU activity)."""

    share: float | None = None
    """Fraction (0-1) of the root stage's GPU time (unions of GPU activity)."""
    launches: int | None = None
    """API calls that launched its GPU work (a CUDA graph launch is one)."""
    sync_ms: float | None = None
    """Host time in syncs charged to its GPU work (the host waited this long for it)."""
    wait_ms: float | None = None
    """Host time in syncs inside its CPU ranges (whatever work they waited for)."""
    bound: str | None = None
    """One of :data:`BOUNDS` (rule in docs/traces.md)."""
    comm_ms: float | None = None
    """Union of its communication (NCCL) kernels."""
    comm_overlap: float | None = None
    """Fraction (0-1) of ``comm_ms`` overlapped by its computation kernels; None without comm."""
    idle_ms: float | None = None
    """Time inside its CPU ranges when the GPU (the device: any op of the file) ran nothing, summed over ranges."""
    host_op_ms: float | None = None
    """Time inside its CPU ranges when its process ran a host operator (``cpu_op``); None without operators."""

    def __post_init__(self):
        if self.bound is not None and self.bound not in BOUNDS:
            raise ValueError(f"bound must be one of {BOUNDS} or None; got {self.bound!r}")
        for name in ("share", "comm_overlap"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value <= 1.0 + 1e-9:
                raise ValueError(f"{name} must be in [0, 1]; got {value}")

    def to_dict(self) -> dict:
        return {"gpu_share": self.share, "launches": self.launches, "sync_ms": self.sync_ms,
                "wait_ms": self.wait_ms, "bound": self.bound, "comm_ms": self.comm_ms,
                "comm_overlap": self.comm_overlap, "idle_ms": self.idle_ms, "host_op_ms": self.host_op_ms}


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
    #: GPU share, launches, host waits, verdict, communication.
    gpu: GpuFigures = GpuFigures()
    #: The stage that most often encloses it (None for a root) and its depth in that tree.
    parent: str | None = None
    depth: int = 0
    #: Totals per recorded step (merged rows of traces with step ranges).
    per_step: StepSpread | None = None
    #: Top kernels and the slowest call (only when asked for, ``--kernels N``).
    kernels: tuple[KernelRow, ...] | None = None
    slowest: SlowestCall | None = None
    #: FLOPs, bytes and roofline per step (merged rows of a run with a work sidecar: :mod:`traces.work`).
    work: WorkFigures | None = None

    def __post_init__(self):
        if self.count < 0:
            raise ValueError(f"count must be >= 0; got {self.count}")
        if self.share is not None and not 0.0 <= self.share <= 1.0 + 1e-9:
            raise ValueError(f"share must be in [0, 1]; got {self.share}")
        if self.depth < 0:
            raise ValueError(f"depth must be >= 0; got {self.depth}")

    @classmethod
    def from_samples(cls, name: str, cpu_ms, gpu_ms=None, **kwargs) -> "StageRow":
        """A row from per-range durations (e.g. a live timer's); ``kwargs`` set the other fields."""
        cpu = list(cpu_ms)
        return cls(name=name, count=len(cpu), cpu_ms=Stats.of(cpu),
                   gpu_ms=Stats.of(gpu_ms) if gpu_ms is not None else None, **kwargs)

    def to_dict(self) -> dict:
        """The row in the JSON schema (``rank`` / ``step`` are keys of the enclosing object)."""
        out = {"name": self.name, "parent": self.parent, "count": self.count,
               "cpu_ms": self.cpu_ms.to_dict(), "gpu_ms": self.gpu_ms.to_dict() if self.gpu_ms else None,
               "gpu_span_ms": self.gpu_span_ms, "self_ms": self.self_ms, "share": self.share,
               **self.gpu.to_dict(), "peak_allocated_mib": self.peak_allocated_mib,
               "peak_reserved_mib": self.peak_reserved_mib,
               "per_step": self.per_step.to_dict() if self.per_step else None}
        if self.kernels is not None:
            out["kernels"] = [k.to_dict() for k in self.kernels]
            out["slowest"] = self.slowest.to_dict() if self.slowest else None
        if self.work is not None:
            out["work"] = self.work.to_dict()
        return out


@dataclass(frozen=True)
class SlowOperator:
    """A host operator with slow calls in one stage (:mod:`traces.operators`): merged over the report's files."""

    name: str
    """The operator (``aten::_cudnn_attention_forward``)."""
    stage: str | None
    """The innermost stage whose range holds its slow calls (None: outside every stage)."""
    calls: int
    """All its calls in the report's files (any stage)."""
    slow_calls: int
    host_ms: float
    """Mean host time of a slow call (its duration minus sync waits)."""
    median_ms: float
    """Its median host time per call over all calls (histogram bins ~4% apart)."""
    gpu_ms: float
    """Mean busy time of the GPU work a slow call launched."""
    launches: float
    """Mean launches of a slow call."""
    excess_ms: float
    """Summed over its slow calls: host time above the reference (median or GPU time), at most the GPU's idle time."""
    rule: str
    """``median`` or ``gpu``: which reference most of the excess is measured from."""

    def to_dict(self) -> dict:
        return {"name": self.name, "stage": self.stage, "calls": self.calls, "slow_calls": self.slow_calls,
                "host_ms": self.host_ms, "median_ms": self.median_ms, "gpu_ms": self.gpu_ms,
                "launches": self.launches, "excess_ms": self.excess_ms, "rule": self.rule}

"""Summaries of stage records: ``collect_stages()`` per call, and the live per-stage table.

``collect_stages()`` wraps one ``Rollout.generate`` call. With ``OPSD_PROFILE=1`` it yields a
:class:`StageCollector` (timing every stage inside the block, also outside a profiler session);
otherwise it yields None through the shared :data:`instrumentation.NOOP` (no allocation, no timers).
"""

from __future__ import annotations

from typing import Iterable, Optional

from instrumentation import stages
from instrumentation.noop import NOOP
from instrumentation.state import get_config
from instrumentation.table import Column, fixed, percent, render
from instrumentation.timers import BYTES_PER_MIB, HUB, StageRecord, StageTimers, TimerBackend

_ORDER = {name: i for i, name in enumerate(stages.ALL_STAGES)}


def summarize(records: Iterable[StageRecord], backend: TimerBackend) -> dict[str, dict]:
    """``{stage: {"count", "host_ms", "device_ms", "peak_allocated_mib"}}`` in stage order.

    ``count`` is the number of calls (a coalesced run of the light mode counts its ``calls``); times
    are totals over the calls (a run's device time is the span of its calls, see
    :mod:`instrumentation.light`); ``device_ms`` equals ``host_ms`` on CPU; the peak is the max over
    the calls, None where memory was not tracked (CPU, or steps that are not recorded).
    """
    out: dict[str, dict] = {}
    for record in records:
        entry = out.setdefault(record.stage, {"count": 0, "host_ms": 0.0, "device_ms": 0.0,
                                              "peak_allocated_mib": None})
        entry["count"] += record.calls
        entry["host_ms"] += record.host_ms
        entry["device_ms"] += record.device_ms(backend)
        if record.peak_bytes is not None:
            peak_mib = record.peak_bytes / BYTES_PER_MIB
            entry["peak_allocated_mib"] = max(entry["peak_allocated_mib"] or 0.0, peak_mib)
    return dict(sorted(out.items(), key=lambda item: _ORDER.get(item[0], len(_ORDER))))


class StageCollector:
    """Collects the stage records of one block; ``summary()`` gives the per-stage totals."""

    coalesce_runs = False
    """One record per call (peaks per call), never a coalesced run (see :mod:`instrumentation.light`)."""

    def __init__(self, hub: StageTimers = HUB):
        self._hub = hub
        self._records: list[StageRecord] = []
        self.allows_reset = False
        """Peaks are reset only when no profiler session is open (there, only recorded steps reset)."""

    def add(self, record: StageRecord) -> None:
        self._records.append(record)

    def __enter__(self) -> "StageCollector":
        self.allows_reset = self._hub.num_sessions == 0
        self._hub.add_sink(self)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._hub.remove_sink(self)
        return False

    @property
    def records(self) -> list[StageRecord]:
        return list(self._records)

    def summary(self) -> dict[str, dict]:
        """Per-stage totals of the stages that ran inside the block (see :func:`summarize`)."""
        return summarize(self._records, self._hub.backend)


def collect_stages():
    """Context manager yielding a :class:`StageCollector` when ``OPSD_PROFILE=1``, else None
    (through the shared :data:`instrumentation.NOOP`)."""
    return StageCollector(HUB) if get_config().timing else NOOP


class StageTable:
    """Running per-stage totals over the recorded steps of a profiler session. A warm-up step (the process's
    first: CUDA-graph captures, compilation, kernels built per shape) is kept apart in :attr:`warmup`, so that it
    does not inflate the means of the others (a 3B run's prefill read 677 ms from step 0's captures)."""

    def __init__(self, keeps_warmup_apart: bool = True):
        self._stats: dict[str, dict] = {}
        self.num_steps = 0
        self.wall_ms = 0.0
        """Host wall time of the recorded steps (used when no ``opsd/step`` range was recorded)."""
        self.warmup = StageTable(keeps_warmup_apart=False) if keeps_warmup_apart else None
        """The warm-up steps' own table (None inside a warm-up table)."""

    def add_step(self, summary: dict[str, dict], wall_ms: float, warmup: bool = False) -> None:
        """Add one recorded step's summary (``warmup``: to :attr:`warmup` instead)."""
        if warmup and self.warmup is not None:
            self.warmup.add_step(summary, wall_ms)
            return
        self.num_steps += 1
        self.wall_ms += wall_ms
        for name, entry in summary.items():
            stats = self._stats.setdefault(name, {"count": 0, "total_ms": 0.0, "host_ms": 0.0,
                                                  "peak_mib": None})
            stats["count"] += entry["count"]
            stats["total_ms"] += entry["device_ms"]
            stats["host_ms"] += entry["host_ms"]
            if entry["peak_allocated_mib"] is not None:
                stats["peak_mib"] = max(stats["peak_mib"] or 0.0, entry["peak_allocated_mib"])

    def rows(self, with_warmup: bool = False) -> list[dict]:
        """Plain rows: stage, count, total_ms, mean_ms, host_total_ms, share_of_step, peak_mib, over the steps after
        the warm-up (over the warm-up when it is the only step recorded; ``with_warmup``: over every step).

        ``total_ms`` is device time (host time on CPU); ``share_of_step`` is ``total_ms`` over the
        total of ``opsd/step`` (or the recorded steps' wall time when no step range was recorded).
        Nested stages overlap, so shares do not add up to 1.
        """
        warm = self.warmup
        if warm is not None and warm.num_steps and (with_warmup or not self.num_steps):
            merged = StageTable(keeps_warmup_apart=False)
            for table in (warm, self) if with_warmup else (warm,):
                merged.num_steps += table.num_steps
                merged.wall_ms += table.wall_ms
                for name, stats in table._stats.items():
                    into = merged._stats.setdefault(name, {"count": 0, "total_ms": 0.0, "host_ms": 0.0,
                                                           "peak_mib": None})
                    for key in ("count", "total_ms", "host_ms"):
                        into[key] += stats[key]
                    if stats["peak_mib"] is not None:
                        into["peak_mib"] = max(into["peak_mib"] or 0.0, stats["peak_mib"])
            return merged.rows()
        step = self._stats.get(stages.STEP)
        step_ms = step["total_ms"] if step else self.wall_ms
        rows = []
        for name in sorted(self._stats, key=lambda n: _ORDER.get(n, len(_ORDER))):
            stats = self._stats[name]
            rows.append({
                "stage": name, "count": stats["count"], "total_ms": stats["total_ms"],
                "mean_ms": stats["total_ms"] / stats["count"], "host_total_ms": stats["host_ms"],
                "share_of_step": stats["total_ms"] / step_ms if step_ms > 0 else None,
                "peak_mib": stats["peak_mib"],
            })
        return rows


def format_stage_rows(rows: list[dict], title: Optional[str] = None) -> str:
    """:meth:`StageTable.rows` as an aligned text table (``instrumentation.table.render``; ``-`` = no value)."""
    columns = [Column("stage", "stage", left=True), Column("count", "count"),
               Column("total_ms", "total ms", fixed(3)), Column("mean_ms", "mean ms", fixed(3)),
               Column("share_of_step", "share", percent(1)), Column("peak_mib", "peak MiB", fixed(1))]
    return render(columns, [[row[c.key] for c in columns] for row in rows], "table", title)

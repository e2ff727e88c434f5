"""The headline of a rank: step wall time, GPU busy share, and where the GPU's idle time went (pure).

Over the root stage's ranges (``opsd/step``, else the outermost stage) of one rank:

- ``wall_ms``: their CPU durations, summed;
- ``gpu_busy_ms``: the union of every GPU op of the rank's device(s) inside those windows (also ops
  without a matched launch); ``gpu_busy_pct`` = 100 * busy / wall;
- idle = wall - busy, split over each gap of the union by the GPU op that ends the gap:
  ``host_launch_ms`` / ``host_sync_ms`` when that op was launched after the GPU went idle (nothing
  was queued: the GPU waited for the host), divided by whether the host sat in a sync call
  (``host_sync``) or not (``host_launch``: Python, launch overhead) during the gap; a gap at the end
  of the window counts as waiting for the host too; ``other_ms`` when the op was already queued when
  the GPU went idle (dependencies between streams, events, launch latency) or has no known launch.
  On one stream the two host parts add up to HTA's ``host_wait`` and ``other`` to its
  ``kernel_wait + other`` (``get_idle_time_breakdown``), plus the gaps before the first and after
  the last op of the window.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from traces.gpu import GpuOps
from traces.host import SyncWaits
from traces.intervals import covered_length, gaps, merge


@dataclass(frozen=True)
class Idle:
    """Where the GPU's idle time inside the root windows went (ms)."""

    host_launch_ms: float
    host_sync_ms: float
    other_ms: float

    def to_dict(self) -> dict:
        return {"host_launch_ms": self.host_launch_ms, "host_sync_ms": self.host_sync_ms,
                "other_ms": self.other_ms}


@dataclass(frozen=True)
class Headline:
    """The first line of a report (see the module docstring); GPU fields None without GPU activity."""

    stage: str
    wall_ms: float
    gpu_busy_ms: float | None = None
    idle: Idle | None = None
    num_ranges: int = 0

    @property
    def gpu_busy_pct(self) -> float | None:
        if self.gpu_busy_ms is None:
            return None
        return 100.0 * self.gpu_busy_ms / self.wall_ms if self.wall_ms > 0 else 0.0

    def to_dict(self) -> dict:
        return {"stage": self.stage, "wall_ms": self.wall_ms, "gpu_busy_pct": self.gpu_busy_pct,
                "gpu_busy_ms": self.gpu_busy_ms, "idle": self.idle.to_dict() if self.idle else None}

    @classmethod
    def total(cls, parts: list["Headline"]) -> "Headline | None":
        """The sum of several ranks' headlines (same stage); None for no parts."""
        if not parts:
            return None
        gpu = [p for p in parts if p.gpu_busy_ms is not None]
        idle = None
        if gpu:
            idle = Idle(*(sum(getattr(p.idle, f) for p in gpu)
                          for f in ("host_launch_ms", "host_sync_ms", "other_ms")))
        return cls(parts[0].stage, sum(p.wall_ms for p in parts),
                   sum(p.gpu_busy_ms for p in gpu) if gpu else None, idle,
                   sum(p.num_ranges for p in parts))


def _coverage(starts: np.ndarray, ends: np.ndarray):
    """A vectorised ``t -> length of (-inf, t] covered by the intervals``."""
    s, e = merge(starts, ends)
    lengths = e - s
    cum = np.concatenate(([0.0], np.cumsum(lengths)))

    def covered(t: np.ndarray) -> np.ndarray:
        t = np.asarray(t, dtype=np.float64)
        if len(s) == 0:
            return np.zeros_like(t)
        i = np.searchsorted(s, t, "right")
        j = np.maximum(i - 1, 0)
        return np.where(i > 0, cum[j] + np.clip(t - s[j], 0.0, lengths[j]), 0.0)

    return covered


def window_idle(gpu: GpuOps, waits: SyncWaits, pid: int, lo: float, hi: float) -> tuple[float, Idle]:
    """(busy us, idle split in us) of the device(s) of one file inside ``[lo, hi]``."""
    start, end, launch = gpu.device
    busy = covered_length(start, end, lo, hi)
    gap_s, gap_e = gaps(start, end, lo, hi)
    nxt = np.searchsorted(start, gap_e, "left")
    has_op = (gap_e < hi) & (nxt < len(start))
    closing = np.full(len(gap_s), np.inf)
    closing[has_op] = launch[nxt[has_op]]
    host = ~(closing <= gap_s)  # launched after the GPU went idle (nan/no launch: other)
    host[has_op & np.isnan(closing)] = False
    covered = _coverage(*waits.intervals(pid))
    in_sync = covered(gap_e) - covered(gap_s)
    width = gap_e - gap_s
    idle = Idle(float(width[host].sum() - in_sync[host].sum()), float(in_sync[host].sum()),
                float(width[~host].sum()))
    return busy, idle


def headline(stage: str, windows: list[tuple], has_gpu: bool) -> Headline:
    """The headline of ``windows``: ``(gpu_ops, sync_waits, pid, start_us, end_us)`` per root range."""
    wall = sum(hi - lo for _, _, _, lo, hi in windows)
    if not has_gpu:
        return Headline(stage, wall / 1e3, num_ranges=len(windows))
    busy, parts = 0.0, np.zeros(3)
    for gpu, waits, pid, lo, hi in windows:
        b, idle = window_idle(gpu, waits, pid, lo, hi)
        busy += b
        parts += (idle.host_launch_ms, idle.host_sync_ms, idle.other_ms)
    return Headline(stage, wall / 1e3, busy / 1e3, Idle(*(float(p) / 1e3 for p in parts)), len(windows))

"""Peak allocator memory of a window, from the ``[memory]`` samples of one file (pure)."""

from __future__ import annotations

import numpy as np

from traces.events import CUDA_DEVICE_TYPE, TraceData


class MemoryPeaks:
    """Allocator samples of one file, per process, on the process's main device (its CUDA device
    with the most samples, else the CPU)."""

    def __init__(self, data: TraceData):
        best: dict[int, tuple] = {}
        for (pid, dev_type, dev_id), samples in data.memory.items():
            rank_key = (dev_type == CUDA_DEVICE_TYPE, len(samples.ts_us))
            if pid not in best or rank_key > best[pid][0]:
                best[pid] = (rank_key, samples)
        self._by_pid = {}
        for pid, (_, samples) in best.items():
            ts = np.frombuffer(samples.ts_us, dtype=np.float64)
            order = np.argsort(ts, kind="stable")
            self._by_pid[pid] = (ts[order],
                                 np.frombuffer(samples.allocated_bytes, dtype=np.int64)[order],
                                 np.frombuffer(samples.reserved_bytes, dtype=np.int64)[order])

    def peak(self, pid: int, start_us: float, end_us: float) -> tuple[int | None, int | None]:
        """(peak allocated, peak reserved) bytes in the window, counting the level carried in."""
        arrays = self._by_pid.get(pid)
        if arrays is None:
            return None, None
        ts, alloc, reserved = arrays
        i0, i1 = np.searchsorted(ts, start_us, "left"), np.searchsorted(ts, end_us, "right")
        i0 = i0 - 1 if i0 > 0 else 0  # the level carried into the window
        if i0 >= i1:
            return None, None
        return int(alloc[i0:i1].max()), int(reserved[i0:i1].max())

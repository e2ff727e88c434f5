"""Host waits of one file: where the host sat in synchronizing calls, and whose GPU work it waited for.

A sync is a ``SYNC`` tuple (``cudaStreamSynchronize``, ``cudaDeviceSynchronize`` ...). Its duration
is charged to the GPU ops of the same process that ran during it, in proportion to how long each ran
inside the wait (the wait is split among the work it waited for); a stage then gets the charges of
the ops it launched (:meth:`SyncWaits.charged_us`). A wait during which none of the process's GPU ops
ran is charged to the stages whose CPU window contains the call. Pure numpy.
"""

from __future__ import annotations

import numpy as np

from traces.events import TraceData
from traces.gpu import GpuOps, PidOps


class SyncWaits:
    """See the module docstring."""

    def __init__(self, data: TraceData, gpu: GpuOps):
        pids = np.frombuffer(data.sync_pid, dtype=np.int64)
        starts = np.frombuffer(data.sync_start_us, dtype=np.float64)
        ends = np.frombuffer(data.sync_end_us, dtype=np.float64)
        self._syncs: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._op_charge: dict[int, np.ndarray] = {}
        self._loose: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._longest: dict[int, float] = {}
        for pid in np.unique(pids):
            sel = pids == pid
            order = np.argsort(starts[sel], kind="stable")
            s, e = starts[sel][order], ends[sel][order]
            self._syncs[int(pid)] = (s, e)
            self._longest[int(pid)] = float((e - s).max())
            self._charge(int(pid), s, e, gpu.by_pid.get(int(pid)))

    def _charge(self, pid: int, s: np.ndarray, e: np.ndarray, ops: PidOps | None) -> None:
        """Split each wait ``[s_i, e_i]`` over the ops running in it (vectorised over all pairs)."""
        n = 0 if ops is None else len(ops.start_us)
        charge, weight = np.zeros(n), np.zeros(len(s))
        if n and len(s):
            by_start = np.argsort(ops.start_us, kind="stable")
            op_s, op_e = ops.start_us[by_start], ops.end_us[by_start]
            lo = np.searchsorted(op_s, s - float((op_e - op_s).max()), "left")
            counts = np.searchsorted(op_s, e, "left") - lo
            wait = np.repeat(np.arange(len(s)), counts)  # (wait, op) pairs that may overlap
            first = np.repeat(np.cumsum(counts) - counts, counts)
            op = np.arange(int(counts.sum())) - first + np.repeat(lo, counts)
            overlap = np.clip(np.minimum(op_e[op], e[wait]) - np.maximum(op_s[op], s[wait]), 0.0, None)
            weight = np.bincount(wait, overlap, minlength=len(s))
            share = np.where(weight[wait] > 0, overlap / np.where(weight[wait] > 0, weight[wait], 1.0), 0.0)
            charge = np.bincount(by_start[op], share * (e - s)[wait], minlength=n)
        loose = weight <= 0  # no op of the process ran during the wait
        self._op_charge[pid] = np.concatenate(([0.0], np.cumsum(charge)))
        self._loose[pid] = (s[loose], np.concatenate(([0.0], np.cumsum((e - s)[loose]))))

    def charged_us(self, pid: int, i0: int, i1: int, start_us: float, end_us: float) -> float:
        """Host wait charged to the ops ``[i0, i1)`` of ``pid`` plus the waits without GPU work
        called inside ``[start_us, end_us]``."""
        total = 0.0
        cum = self._op_charge.get(pid)
        if cum is not None and i1 > i0:
            total += float(cum[i1] - cum[i0])
        loose = self._loose.get(pid)
        if loose is not None and len(loose[0]):
            a, b = np.searchsorted(loose[0], start_us, "left"), np.searchsorted(loose[0], end_us, "right")
            total += float(loose[1][b] - loose[1][a])
        return total

    def waited_us(self, pid: int, start_us: float, end_us: float) -> float:
        """Host time ``pid`` spent in syncs inside ``[start_us, end_us]``."""
        s, e = self.intervals(pid)
        if len(s) == 0 or end_us <= start_us:
            return 0.0
        lo = np.searchsorted(s, start_us - self._longest[pid], "left")
        hi = np.searchsorted(s, end_us, "right")
        s, e = s[lo:hi], e[lo:hi]
        return float(np.clip(np.minimum(e, end_us) - np.maximum(s, start_us), 0.0, None).sum())

    def intervals(self, pid: int) -> tuple[np.ndarray, np.ndarray]:
        """The sync calls of ``pid`` as (starts, ends) sorted by start."""
        return self._syncs.get(pid, (np.empty(0), np.empty(0)))

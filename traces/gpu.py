"""GPU ops of one file, indexed by the process and CPU time of their launches (pure numpy).

A GPU op (kernel, memcpy, memset) belongs to the launch (``cuda_runtime`` / ``cuda_driver`` event)
with the same correlation id in the file; every kernel of a CUDA graph carries the correlation of its
``cudaGraphLaunch``, so a graph is one launch with many ops. Per process, the matched ops are sorted
by launch time: the ops launched inside a CPU window are one contiguous slice. Ops without a
matched launch still count as GPU activity of the device (the headline's busy time).

Kinds of op, by name: memory operations start with ``Memcpy`` / ``Memset``; communication kernels
contain ``nccl`` (any case: ``ncclDevKernel_AllGather_RING_LL``, ``ncclKernel_AllReduce_...``);
the other kernels are computation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from traces.events import MEMORY_OP_PREFIXES, TraceData
from traces.intervals import merge, union_length

#: Kinds of GPU op.
COMPUTE, MEMORY, COMM = 0, 1, 2


def is_comm_kernel(name: str) -> bool:
    """Whether a GPU op is a communication (NCCL) kernel."""
    return "nccl" in name.lower()


#: Name parts of matrix-multiply kernels (cuBLAS / cuBLASLt / CUTLASS / nvjet / Triton matmuls).
GEMM_MARKS = ("gemm", "nvjet", "xmma", "cutlass", "matmul", "wgmma", "s16816", "s1688", "cublas")


def is_gemm_kernel(name: str) -> bool:
    """Whether a kernel is a matrix multiply, by the name parts of the GEMM libraries (:data:`GEMM_MARKS`)."""
    lower = name.lower()
    return any(mark in lower for mark in GEMM_MARKS)


def is_memory_op(name: str) -> bool:
    """Whether a GPU op is a memcpy or memset."""
    return name.startswith(MEMORY_OP_PREFIXES)


@dataclass
class PidOps:
    """The matched GPU ops launched by one process, sorted by launch time (then correlation)."""

    launch_us: np.ndarray
    start_us: np.ndarray
    end_us: np.ndarray
    name_id: np.ndarray
    kind: np.ndarray
    """:data:`COMPUTE`, :data:`MEMORY` or :data:`COMM` per op."""
    launch_cum: np.ndarray
    """``launch_cum[i]`` = distinct launches among ops ``[0, i)`` (length n + 1)."""
    names: list
    """Op names of the file (``name_id`` indexes it)."""

    def window(self, start_us: float, end_us: float) -> tuple[int, int]:
        """Index range ``[i0, i1)`` of the ops launched inside the CPU window."""
        i0 = int(np.searchsorted(self.launch_us, start_us, "left"))
        return i0, int(np.searchsorted(self.launch_us, end_us, "right"))

    def launches(self, i0: int, i1: int) -> int:
        """Number of distinct launches (API calls) among ops ``[i0, i1)``."""
        return int(self.launch_cum[i1] - self.launch_cum[i0]) if i1 > i0 else 0


class GpuOps:
    """The GPU ops of one file (see the module docstring)."""

    def __init__(self, data: TraceData):
        self.available = data.has_gpu
        self.names: list[str] = list(data.names)
        self.kind_of_name = np.array([COMM if is_comm_kernel(n) else MEMORY if is_memory_op(n) else COMPUTE
                                      for n in self.names], dtype=np.int8)
        self.by_pid: dict[int, PidOps] = {}
        start = np.frombuffer(data.gpu_start_us, dtype=np.float64)
        end = np.frombuffer(data.gpu_end_us, dtype=np.float64)
        launch_us, launch_pid = _match_launches(data)
        order = np.argsort(start, kind="stable")
        #: every op of the file (matched or not) by start: (start, end, launch time or nan)
        self.device = (start[order], end[order], launch_us[order])
        self._busy = None
        if len(start):
            self._index_by_pid(data, launch_us, launch_pid, start, end)

    def busy_between(self, lo: float, hi: float) -> float:
        """How long any GPU op of the file (the device) ran inside ``[lo, hi]`` (O(log n) after the first call)."""
        if self._busy is None:
            from traces.operators import Coverage

            self._busy = Coverage(*merge(self.device[0], self.device[1]))
        return self._busy.between(lo, hi)

    def idle_between(self, lo: float, hi: float) -> float:
        """How long the device ran no GPU op inside ``[lo, hi]``."""
        return max(0.0, (hi - lo) - self.busy_between(lo, hi)) if hi > lo else 0.0

    def launched_between(self, pid: int, lo: float, hi: float) -> tuple[float, int]:
        """(busy us, launches) of the GPU work ``pid`` launched inside the CPU window ``[lo, hi]``."""
        ops = self.by_pid.get(pid)
        if ops is None:
            return 0.0, 0
        i0, i1 = ops.window(lo, hi)
        if i1 <= i0:
            return 0.0, 0
        return union_length(ops.start_us[i0:i1], ops.end_us[i0:i1]), ops.launches(i0, i1)

    def _index_by_pid(self, data, launch_us, launch_pid, start, end) -> None:
        matched = ~np.isnan(launch_us)
        corr = np.frombuffer(data.gpu_correlation, dtype=np.int64)
        names = np.frombuffer(data.gpu_name, dtype=np.int64)
        for pid in np.unique(launch_pid[matched]):
            sel = np.flatnonzero(matched & (launch_pid == pid))
            sel = sel[np.lexsort((corr[sel], launch_us[sel]))]
            c = corr[sel]
            first = np.ones(len(sel), dtype=np.int64)
            first[1:] = c[1:] != c[:-1]
            self.by_pid[int(pid)] = PidOps(launch_us[sel], start[sel], end[sel], names[sel],
                                           self.kind_of_name[names[sel]],
                                           np.concatenate(([0], np.cumsum(first))), self.names)


def _match_launches(data: TraceData) -> tuple[np.ndarray, np.ndarray]:
    """Per GPU op: the time and process of its launch (nan / -1 when no launch matches)."""
    g_corr = np.frombuffer(data.gpu_correlation, dtype=np.int64)
    launch_us = np.full(len(g_corr), np.nan)
    launch_pid = np.full(len(g_corr), -1, dtype=np.int64)
    l_corr = np.frombuffer(data.launch_correlation, dtype=np.int64)
    if len(l_corr) == 0 or len(g_corr) == 0:
        return launch_us, launch_pid
    order = np.argsort(l_corr, kind="stable")
    l_corr = l_corr[order]
    idx = np.minimum(np.searchsorted(l_corr, g_corr), len(l_corr) - 1)
    ok = l_corr[idx] == g_corr
    launch_us[ok] = np.frombuffer(data.launch_ts_us, dtype=np.float64)[order][idx[ok]]
    launch_pid[ok] = np.frombuffer(data.launch_pid, dtype=np.int64)[order][idx[ok]]
    return launch_us, launch_pid

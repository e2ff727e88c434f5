"""Per-instance stage figures from one file's :class:`~traces.events.TraceData` (pure logic).

A stage instance is one CPU range whose name starts with the prefix. For each instance:

- nesting: ranges of one (pid, tid) nest by containment; ``self_us`` is the duration minus the
  durations of the directly nested stage ranges;
- GPU projection (as Nsight Systems projects NVTX ranges): the kernels, memcpys and memsets whose
  launch (``cuda_runtime`` / ``cuda_driver``, matched by correlation id within the file) starts
  inside the instance's CPU window on any thread of the same process; ``gpu_busy_us`` is the length
  of the union of their intervals, ``gpu_span_us`` first start to last end;
- memory: the peak of ``Total Allocated`` / ``Total Reserved`` over the samples inside the window
  and the level carried into it (the last sample before it), on the process's device: its CUDA
  device with the most samples, else the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from traces.events import CUDA_DEVICE_TYPE, TraceData

#: Containment tolerance: Kineto rounds timestamps to 1 ns, so a child may end 1-2 ns late.
NEST_TOLERANCE_US = 0.01


@dataclass
class StageInstance:
    """One stage range with its measured figures (times in microseconds, memory in bytes)."""

    name: str
    rank: int
    pid: int
    tid: int
    start_us: float
    end_us: float
    self_us: float
    #: None when the trace has no GPU activity at all.
    gpu_busy_us: float | None = None
    gpu_span_us: float | None = None
    #: None when the trace has no memory samples for the process.
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    #: Index of the enclosing step range of the rank (see :func:`assign_steps`).
    step: int | None = None
    path: str = ""

    @property
    def cpu_us(self) -> float:
        return self.end_us - self.start_us


def nest(instances: list[StageInstance]) -> None:
    """Set ``self_us`` of each instance: its duration minus its directly nested instances'."""
    by_thread: dict[tuple, list[StageInstance]] = {}
    for inst in instances:
        by_thread.setdefault((inst.pid, inst.tid), []).append(inst)
    for group in by_thread.values():
        group.sort(key=lambda i: (i.start_us, -i.end_us))
        stack: list[StageInstance] = []
        for inst in group:
            inst.self_us = inst.cpu_us
            while stack and stack[-1].end_us + NEST_TOLERANCE_US < inst.end_us:
                stack.pop()
            if stack and inst.start_us + NEST_TOLERANCE_US >= stack[-1].start_us:
                stack[-1].self_us -= inst.cpu_us
            stack.append(inst)


def union_length(starts: np.ndarray, ends: np.ndarray) -> float:
    """Total length covered by the union of the intervals ``[starts[i], ends[i]]``."""
    if len(starts) == 0:
        return 0.0
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    reach = np.maximum.accumulate(e)
    prev = np.concatenate(([-np.inf], reach[:-1]))
    return float(np.clip(e - np.maximum(s, prev), 0.0, None).sum())


class GpuProjection:
    """GPU intervals of one file indexed by the process and CPU time of their launches."""

    def __init__(self, data: TraceData):
        self.available = data.has_gpu
        self._by_pid: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        if not self.available or len(data.launch_correlation) == 0:
            return
        l_corr = np.frombuffer(data.launch_correlation, dtype=np.int64)
        order = np.argsort(l_corr, kind="stable")
        l_corr = l_corr[order]
        l_pid = np.frombuffer(data.launch_pid, dtype=np.int64)[order]
        l_ts = np.frombuffer(data.launch_ts_us, dtype=np.float64)[order]
        g_corr = np.frombuffer(data.gpu_correlation, dtype=np.int64)
        idx = np.searchsorted(l_corr, g_corr)
        idx_ok = np.minimum(idx, len(l_corr) - 1)
        matched = (idx < len(l_corr)) & (l_corr[idx_ok] == g_corr)
        li = idx_ok[matched]
        g_start = np.frombuffer(data.gpu_start_us, dtype=np.float64)[matched]
        g_end = np.frombuffer(data.gpu_end_us, dtype=np.float64)[matched]
        pids, ts = l_pid[li], l_ts[li]
        for pid in np.unique(pids):
            sel = pids == pid
            o = np.argsort(ts[sel], kind="stable")
            self._by_pid[int(pid)] = (ts[sel][o], g_start[sel][o], g_end[sel][o])

    def project(self, pid: int, start_us: float, end_us: float) -> tuple[float | None, float | None]:
        """(busy, span) in microseconds of the GPU work launched by ``pid`` in the window."""
        if not self.available:
            return None, None
        arrays = self._by_pid.get(pid)
        if arrays is None:
            return 0.0, 0.0
        ts, gs, ge = arrays
        i0, i1 = np.searchsorted(ts, start_us, "left"), np.searchsorted(ts, end_us, "right")
        if i0 >= i1:
            return 0.0, 0.0
        s, e = gs[i0:i1], ge[i0:i1]
        return union_length(s, e), float(e.max() - s.min())


class MemoryPeaks:
    """Allocator samples of one file, per process, on the process's main device."""

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


def file_instances(data: TraceData, rank: int, prefix: str) -> list[StageInstance]:
    """Every stage instance of one file with its self time, GPU projection and memory peaks."""
    instances = [StageInstance(name, rank, pid, tid, start, end, end - start, path=data.path)
                 for name, pid, tid, start, end in data.ranges if name.startswith(prefix)]
    nest(instances)
    gpu, mem = GpuProjection(data), MemoryPeaks(data)
    for inst in instances:
        inst.gpu_busy_us, inst.gpu_span_us = gpu.project(inst.pid, inst.start_us, inst.end_us)
        inst.peak_allocated_bytes, inst.peak_reserved_bytes = mem.peak(
            inst.pid, inst.start_us, inst.end_us)
    return instances


def assign_steps(instances: list[StageInstance], step_name: str) -> int:
    """Number the step ranges of one rank by start time and give every instance its step.

    An instance belongs to step k when it lies inside the k-th step range (0-based, in time order
    over all files of the rank) of the same process; others keep ``step=None``. Returns the
    number of steps.
    """
    steps = sorted((i for i in instances if i.name == step_name), key=lambda i: i.start_us)
    for k, step in enumerate(steps):
        step.step = k
    if not steps:
        return 0
    starts = np.array([s.start_us for s in steps])
    for inst in instances:
        if inst.name == step_name:
            continue
        k = int(np.searchsorted(starts, inst.start_us + NEST_TOLERANCE_US, "right")) - 1
        while k >= 0:
            s = steps[k]
            if s.pid == inst.pid and inst.end_us <= s.end_us + NEST_TOLERANCE_US:
                inst.step = k
                break
            if s.pid == inst.pid:
                break
            k -= 1
    return len(steps)

"""Per-instance stage figures from one file's :class:`~traces.events.TraceData` (pure logic).

A stage instance is one CPU range whose name starts with the prefix. For each instance:

- nesting: ranges of one (pid, tid) nest by containment; ``self_us`` is the duration minus the
  durations of the directly nested stage ranges; the *parent* is the innermost other instance of the
  same process (any thread) whose window contains it, the *depth* the number of such enclosing ranges;
- GPU projection (as Nsight Systems projects NVTX ranges): the kernels, memcpys and memsets whose
  launch starts inside the instance's CPU window on any thread of the same process
  (:mod:`traces.gpu`); ``gpu_busy_us`` is the length of the union of their intervals, ``gpu_span_us``
  first start to last end, ``launches`` the number of API calls that launched them;
- host waits (:mod:`traces.host`): ``sync_us`` is the host wait charged to its GPU work, ``wait_us``
  the host time spent in syncs inside its CPU window;
- memory (:mod:`traces.memory`): the peak of ``Total Allocated`` / ``Total Reserved`` in the window.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from traces.events import TraceData
from traces.gpu import GpuOps, PidOps
from traces.host import SyncWaits
from traces.intervals import union_length
from traces.memory import MemoryPeaks

#: Containment tolerance: Kineto rounds timestamps to 1 ns, so a child may end 1-2 ns late.
NEST_TOLERANCE_US = 0.01
#: torch.profiler's annotation of training step N (its step counter, which ``opsd_profiler`` keeps
#: equal to the training step index).
PROFILER_STEP = re.compile(r"^ProfilerStep#(\d+)$")


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
    #: End of the last GPU op it launched (None without any).
    gpu_end_us: float | None = None
    launches: int | None = None
    sync_us: float | None = None
    wait_us: float = 0.0
    #: None when the trace has no memory samples for the process.
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    #: Training step index of the enclosing step range (see :func:`assign_steps`).
    step: int | None = None
    path: str = ""
    depth: int = 0
    parent: str | None = None
    #: The GPU ops it launched: ``ops`` (its process's) and the index range ``[i0, i1)``.
    ops: PidOps | None = None
    i0: int = 0
    i1: int = 0
    file_start_us: float = 0.0
    #: Device idle inside its CPU range (None without GPU activity), and its process's time in host operators
    #: there (None without ``cpu_op`` events); set by :func:`traces.report.build_report`.
    gpu_idle_us: float | None = None
    host_op_us: float | None = None

    @property
    def cpu_us(self) -> float:
        return self.end_us - self.start_us

    @property
    def window_end_us(self) -> float:
        """End of the instance's window: its CPU end or the end of its last GPU op, the later."""
        return self.end_us if self.gpu_end_us is None else max(self.end_us, self.gpu_end_us)


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


def tree(instances: list[StageInstance]) -> None:
    """Set ``depth`` and ``parent`` from containment among the instances of each process."""
    by_pid: dict[int, list[StageInstance]] = {}
    for inst in instances:
        by_pid.setdefault(inst.pid, []).append(inst)
    for group in by_pid.values():
        group.sort(key=lambda i: (i.start_us, -i.end_us))
        active: list[StageInstance] = []
        for inst in group:
            active = [o for o in active if o.end_us + NEST_TOLERANCE_US >= inst.start_us]
            around = [o for o in active if inst.end_us <= o.end_us + NEST_TOLERANCE_US]
            inst.depth = len(around)
            inst.parent = around[-1].name if around else None
            active.append(inst)


def _project(inst: StageInstance, gpu: GpuOps, waits: SyncWaits) -> None:
    if not gpu.available:
        return
    ops = gpu.by_pid.get(inst.pid)
    inst.gpu_busy_us = inst.gpu_span_us = 0.0
    inst.launches, inst.sync_us = 0, waits.charged_us(inst.pid, 0, 0, inst.start_us, inst.end_us)
    if ops is None:
        return
    i0, i1 = ops.window(inst.start_us, inst.end_us)
    inst.ops, inst.i0, inst.i1 = ops, i0, i1
    inst.sync_us = waits.charged_us(inst.pid, i0, i1, inst.start_us, inst.end_us)
    if i1 > i0:
        s, e = ops.start_us[i0:i1], ops.end_us[i0:i1]
        inst.gpu_busy_us, inst.gpu_span_us = union_length(s, e), float(e.max() - s.min())
        inst.gpu_end_us, inst.launches = float(e.max()), ops.launches(i0, i1)


def file_instances(data: TraceData, rank: int, prefix: str, gpu: GpuOps | None = None,
                   waits: SyncWaits | None = None) -> list[StageInstance]:
    """Every stage instance of one file with its self time, tree place, GPU projection, host waits
    and memory peaks (``gpu`` / ``waits``: the file's, when already built)."""
    instances = [StageInstance(name, rank, pid, tid, start, end, end - start, path=data.path,
                               file_start_us=data.span_start_us)
                 for name, pid, tid, start, end in data.ranges if name.startswith(prefix)]
    nest(instances)
    tree(instances)
    gpu = gpu or GpuOps(data)
    waits, mem = waits or SyncWaits(data, gpu), MemoryPeaks(data)
    for inst in instances:
        _project(inst, gpu, waits)
        inst.wait_us = waits.waited_us(inst.pid, inst.start_us, inst.end_us)
        inst.peak_allocated_bytes, inst.peak_reserved_bytes = mem.peak(
            inst.pid, inst.start_us, inst.end_us)
    return instances


def profiler_steps(data: TraceData) -> list[tuple[int, int, float, float]]:
    """``(step, pid, start_us, end_us)`` of torch.profiler's ``ProfilerStep#N`` ranges of a file."""
    out = []
    for name, pid, _tid, start, end in data.ranges:
        m = PROFILER_STEP.match(name)
        if m is not None:
            out.append((int(m.group(1)), pid, start, end))
    return out


def _step_numbers(steps: list[StageInstance], marks: list[tuple]) -> list[int]:
    """The index of each step range: N of its enclosing ``ProfilerStep#N`` when every step range
    has exactly one and they differ, else 0, 1, ... in time order."""
    numbers = []
    for s in steps:
        found = [n for n, pid, lo, hi in marks if pid == s.pid and lo - NEST_TOLERANCE_US <= s.start_us
                 and s.end_us <= hi + NEST_TOLERANCE_US]
        numbers.append(found[0] if len(found) == 1 else None)
    if None in numbers or len(set(numbers)) != len(numbers):
        return list(range(len(steps)))
    return numbers


def assign_steps(instances: list[StageInstance], step_name: str, marks: list[tuple] = ()) -> int:
    """Give every instance of one rank the index of its step range.

    Step ranges (``step_name``) are numbered by the training step they belong to: the N of the
    ``ProfilerStep#N`` range (``marks``, see :func:`profiler_steps`) around each, else 0, 1, ... in
    time order over all files of the rank. An instance belongs to a step when it lies inside that
    step range of the same process; others keep ``step=None``. Returns the number of step ranges.
    """
    steps = sorted((i for i in instances if i.name == step_name), key=lambda i: i.start_us)
    for step, number in zip(steps, _step_numbers(steps, list(marks))):
        step.step = number
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
                inst.step = s.step
                break
            if s.pid == inst.pid:
                break
            k -= 1
    return len(steps)


def step_problems(instances: list[StageInstance], step_name: str, rank: int) -> list[str]:
    """Warning lines (after :func:`assign_steps`) for what makes one rank's per-step figures differ from its
    totals: step ranges of several processes (numbered as one sequence), step ranges that overlap the previous
    one of their process, and stage ranges outside every step range (in the counts and totals, not in the
    per-step figures). Empty when the rank has no step range."""
    steps = sorted((i for i in instances if i.name == step_name), key=lambda i: (i.pid, i.start_us))
    if not steps:
        return []
    out = []
    pids = sorted({s.pid for s in steps})
    if len(pids) > 1:
        out.append(f"rank {rank}: {step_name!r} ranges of {len(pids)} processes (pids "
                   f"{', '.join(map(str, pids[:4]))}{', ...' if len(pids) > 4 else ''}) are numbered as one rank's "
                   "steps: give each process its own rank (distributedInfo.rank, or one file per rank)")
    overlaps = sum(1 for a, b in zip(steps, steps[1:]) if a.pid == b.pid and b.start_us + NEST_TOLERANCE_US < a.end_us)
    if overlaps:
        out.append(f"rank {rank}: {overlaps} {step_name!r} range{'s overlap' if overlaps != 1 else ' overlaps'} the "
                   "previous one; a stage range is counted in one step only")
    outside: dict[str, int] = {}
    for inst in instances:
        if inst.step is None and inst.name != step_name:
            outside[inst.name] = outside.get(inst.name, 0) + 1
    if outside:
        names = sorted(outside, key=lambda n: (-outside[n], n))
        listed = ", ".join(f"{outside[n]} {n[:80]!r}" for n in names[:4]) + (", ..." if len(names) > 4 else "")
        out.append(f"rank {rank}: {sum(outside.values())} stage range(s) outside every {step_name!r} range ({listed}): "
                   "in the counts and totals, not in the per-step figures")
    return out

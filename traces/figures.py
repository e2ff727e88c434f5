"""Figures of a stage over a group of its instances (pure): GPU unions, verdict, kernels, comm.

The instances of one stage in one scope (merged, a rank, a step) may come from several files; GPU
time is a union per file (files are per rank, each on its own clock and device) summed over files.

Verdict (``bound``) of a stage, from its *window* (the union over its instances of CPU start to the
later of CPU end and the end of the last GPU op it launched) and its GPU busy share of that window:

- ``gpu`` when its GPU busy time (union of the GPU work it launched) covers more than
  :data:`GPU_FRACTION` (60%) of the window: the GPU is the limit (CUDA-graph decode, whose short CPU ranges launch
  work that runs later);
- else ``sync`` when the host spent at least half of the window waiting in syncs inside the stage's
  CPU ranges (waiting for work it did not launch, e.g. a ``.item()`` behind earlier stages);
- else ``host`` below :data:`HOST_FRACTION` (40%) busy: the host (Python, launches) is the limit (eager prefill, the
  optimizer step);
- else ``mixed``: neither dominates (40-60% busy), so no single fix applies (a hard 50% cut called a stage at
  50.7% busy GPU-bound).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from traces.compute import StageInstance
from traces.gpu import COMM, COMPUTE, PidOps
from traces.intervals import intersection_length, merge, union_length
from traces.records import KernelRow, SlowestCall

#: GPU busy above this fraction of the window: ``gpu`` bound.
GPU_FRACTION = 0.6
#: GPU busy below this fraction of the window (and no dominant waits): ``host`` bound; between the two, ``mixed``.
HOST_FRACTION = 0.4
#: Waits in syncs of at least this fraction of the window: ``sync`` bound.
SYNC_FRACTION = 0.5


def bound(busy_us: float, wait_us: float, window_us: float) -> str:
    """``gpu``, ``sync``, ``host`` or ``mixed`` (see the module docstring)."""
    if window_us <= 0:
        return "host"
    if busy_us > GPU_FRACTION * window_us:
        return "gpu"
    if wait_us >= SYNC_FRACTION * window_us:
        return "sync"
    return "host" if busy_us < HOST_FRACTION * window_us else "mixed"


def _op_indices(instances: list[StageInstance]) -> list[tuple[PidOps, np.ndarray]]:
    """Per process of a file: the indices of the ops the instances launched (each op once)."""
    groups: dict[int, tuple[PidOps, list]] = {}
    for inst in instances:
        if inst.ops is not None and inst.i1 > inst.i0:
            groups.setdefault(id(inst.ops), (inst.ops, []))[1].append(np.arange(inst.i0, inst.i1))
    return [(ops, np.unique(np.concatenate(parts))) for ops, parts in groups.values()]


@dataclass(frozen=True)
class GroupGpu:
    """GPU unions of a group of instances of one stage (microseconds)."""

    busy_us: float
    window_us: float
    wait_us: float
    comm_us: float
    compute_us: float
    overlap_us: float


def group_gpu(instances: list[StageInstance]) -> GroupGpu:
    """Busy, window, host-wait and communication figures of a group (see the module docstring)."""
    busy = comm = compute = overlap = 0.0
    for ops, idx in _op_indices(instances):
        s, e, kind = ops.start_us[idx], ops.end_us[idx], ops.kind[idx]
        busy += union_length(s, e)
        c, k = (s[kind == COMM], e[kind == COMM]), (s[kind == COMPUTE], e[kind == COMPUTE])
        comm, compute = comm + union_length(*c), compute + union_length(*k)
        overlap += intersection_length(c, k) if len(c[0]) and len(k[0]) else 0.0
    window = 0.0
    for path in {i.path for i in instances}:
        mine = [i for i in instances if i.path == path]
        window += union_length([i.start_us for i in mine], [i.window_end_us for i in mine])
    wait = sum(i.wait_us for i in instances)
    return GroupGpu(busy, window, wait, comm, compute, overlap)


def top_kernels(instances: list[StageInstance], n: int) -> tuple[KernelRow, ...]:
    """The ``n`` op names with the most GPU time (summed durations) among the group's GPU work."""
    totals: dict[str, list] = {}
    for ops, idx in _op_indices(instances):
        ids, dur = ops.name_id[idx], ops.end_us[idx] - ops.start_us[idx]
        for name_id in np.unique(ids):
            sel = ids == name_id
            entry = totals.setdefault(ops.names[int(name_id)], [0, 0.0])
            entry[0] += int(sel.sum())
            entry[1] += float(dur[sel].sum())
    ranked = sorted(totals.items(), key=lambda kv: (-kv[1][1], kv[0]))[:n]
    return tuple(KernelRow(name, count, total / 1e3) for name, (count, total) in ranked)


def slowest_call(instances: list[StageInstance]) -> SlowestCall | None:
    """The instance with the longest window (CPU start to end of its last GPU work)."""
    if not instances:
        return None
    inst = max(instances, key=lambda i: (i.window_end_us - i.start_us, -i.start_us))
    return SlowestCall(inst.start_us, (inst.start_us - inst.file_start_us) / 1e3,
                       (inst.window_end_us - inst.start_us) / 1e3, inst.path, inst.rank)

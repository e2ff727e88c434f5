"""The source-independent event model: compact tuples that every trace source yields.

A source (Chrome JSON today, an Nsight Systems SQLite export later) turns a file into an iterator
of the tuples below; :func:`collect` keeps only what the report needs in compact arrays
(:class:`TraceData`). Times are microseconds on the source's own clock.

Tuple layouts (first element is the kind):

- ``(RANGE, name, pid, tid, start_us, dur_us)``: a CPU range (a ``user_annotation`` complete event).
- ``(LAUNCH, pid, tid, start_us, correlation)``: a ``cuda_runtime`` / ``cuda_driver`` API call.
- ``(GPU, correlation, start_us, dur_us, device)``: a kernel, memcpy or memset on a GPU.
- ``(MEMORY, pid, ts_us, device_type, device_id, allocated_bytes, reserved_bytes)``: an
  allocator sample (``[memory]`` instant event); ``device_type`` 0 is CPU, 1 is CUDA.
- ``(SPAN, start_us, dur_us)``: an interval that bounds the profiled window (``Trace`` events).
- ``(META, key, value)``: trace metadata, e.g. ``("rank", 3)`` from ``distributedInfo``.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Protocol

RANGE, LAUNCH, GPU, MEMORY, SPAN, META = range(6)

#: ``device_type`` of CUDA memory samples (c10's DeviceType enum); 0 is CPU.
CUDA_DEVICE_TYPE = 1


class EventSource(Protocol):
    """Anything that turns one trace file into the compact event tuples of this module."""

    def __call__(self, path: str) -> Iterator[tuple]:
        """Yield the event tuples of ``path``; raise :class:`TraceError` on unreadable input."""
        ...


class TraceError(Exception):
    """A trace file that cannot be read; ``str()`` is one line naming the file and the problem."""

    def __init__(self, path: str, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


@dataclass
class MemorySamples:
    """Allocator samples of one (process, device), in file order."""

    ts_us: array = field(default_factory=lambda: array("d"))
    allocated_bytes: array = field(default_factory=lambda: array("q"))
    reserved_bytes: array = field(default_factory=lambda: array("q"))


@dataclass
class TraceData:
    """What the report needs from one trace file, kept in compact arrays.

    ``ranges`` holds every CPU range (name, pid, tid, start_us, end_us); the prefix filter is applied
    later so one load serves any ``--prefix``.
    """

    path: str
    rank: int | None = None
    ranges: list = field(default_factory=list)
    launch_pid: array = field(default_factory=lambda: array("q"))
    launch_ts_us: array = field(default_factory=lambda: array("d"))
    launch_correlation: array = field(default_factory=lambda: array("q"))
    gpu_correlation: array = field(default_factory=lambda: array("q"))
    gpu_start_us: array = field(default_factory=lambda: array("d"))
    gpu_end_us: array = field(default_factory=lambda: array("d"))
    #: (pid, device_type, device_id) -> samples
    memory: dict = field(default_factory=dict)
    span_start_us: float = float("inf")
    span_end_us: float = float("-inf")
    num_malformed: int = 0

    @property
    def span_us(self) -> float:
        """Length of the profiled window: first to last timestamp of the kept events."""
        return max(0.0, self.span_end_us - self.span_start_us)

    @property
    def has_gpu(self) -> bool:
        """Whether the trace recorded any GPU activity."""
        return len(self.gpu_start_us) > 0


def collect(path: str, events: Iterable[tuple]) -> TraceData:
    """Gather the event tuples of one file into a :class:`TraceData`."""
    data = TraceData(path=path)
    lo, hi = data.span_start_us, data.span_end_us
    ranges_append = data.ranges.append
    for ev in events:
        kind = ev[0]
        if kind == RANGE:
            _, name, pid, tid, start, dur = ev
            ranges_append((name, pid, tid, start, start + dur))
            lo, hi = min(lo, start), max(hi, start + dur)
        elif kind == GPU:
            data.gpu_correlation.append(ev[1])
            data.gpu_start_us.append(ev[2])
            data.gpu_end_us.append(ev[2] + ev[3])
            lo, hi = min(lo, ev[2]), max(hi, ev[2] + ev[3])
        elif kind == LAUNCH:
            data.launch_pid.append(ev[1])
            data.launch_ts_us.append(ev[3])
            data.launch_correlation.append(ev[4])
        elif kind == MEMORY:
            _, pid, ts, dev_type, dev_id, alloc, reserved = ev
            samples = data.memory.get((pid, dev_type, dev_id))
            if samples is None:
                samples = data.memory[(pid, dev_type, dev_id)] = MemorySamples()
            samples.ts_us.append(ts)
            samples.allocated_bytes.append(alloc)
            samples.reserved_bytes.append(reserved)
        elif kind == SPAN:
            lo, hi = min(lo, ev[1]), max(hi, ev[1] + ev[2])
        elif kind == META:
            if ev[1] == "rank":
                data.rank = ev[2]
            elif ev[1] == "malformed":
                data.num_malformed += ev[2]
    data.span_start_us, data.span_end_us = lo, hi
    return data

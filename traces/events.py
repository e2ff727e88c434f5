"""The source-independent event model: compact tuples that every trace source yields.

A source (Chrome JSON, an Nsight Systems SQLite export) turns a file into an iterator of the tuples
below; :func:`collect` keeps only what the report needs in compact arrays (:class:`TraceData`).
Times are microseconds on the source's own clock.

Tuple layouts (first element is the kind):

- ``(RANGE, name, pid, tid, start_us, dur_us)``: a CPU range (a ``user_annotation`` complete event).
- ``(LAUNCH, pid, tid, start_us, correlation)``: a ``cuda_runtime`` / ``cuda_driver`` API call.
- ``(GPU, correlation, start_us, dur_us, device, name, stream)``: a kernel, memcpy or memset on a
  GPU (``name`` as the source writes it, ``stream`` -1 when unknown).
- ``(MEMORY, pid, ts_us, device_type, device_id, allocated_bytes, reserved_bytes)``: an
  allocator sample (``[memory]`` instant event); ``device_type`` 0 is CPU, 1 is CUDA.
- ``(SPAN, start_us, dur_us)``: an interval that bounds the profiled window (``Trace`` events).
- ``(META, key, value)``: trace metadata, e.g. ``("rank", 3)`` from ``distributedInfo``, or ``("note", text)``:
  a warning about it (a rank that is not used, or not below ``world_size``).
- ``(SYNC, pid, tid, start_us, dur_us)``: a host call that blocks until GPU work has finished
  (:data:`SYNC_CALLS`: ``cudaStreamSynchronize``, ``cudaDeviceSynchronize`` ...).
- ``(BAD, reason, example)``: an event the source skipped (:mod:`traces.bad`).
- ``(OP, name, pid, tid, start_us, dur_us)``: a host operator call (a ``cpu_op`` complete event, ``aten::mm``);
  kept in bounded form (:class:`traces.operators.OpCalls`: per name a count and a histogram of host times, the
  long calls in full, the union of the calls' time per process).

:func:`collect` also skips (as bad events) tuples with a non-finite or implausible time
(:data:`traces.bad.MAX_TS_US`, :data:`traces.bad.MAX_DUR_US`), a negative duration, negative
allocator bytes or fields of the wrong type: such values never reach a total. Range and GPU op names are
made printable (:mod:`traces.names`) once, as they are kept.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Protocol

from traces.bad import BAD, MAX_DUR_US, MAX_TS_US, BadEvents, example, time_reason
from traces.names import printable
from traces.operators import OpCalls

RANGE, LAUNCH, GPU, MEMORY, SPAN, META, SYNC = range(7)
assert BAD == 7
OP = 8

#: ``device_type`` of CUDA memory samples (c10's DeviceType enum); 0 is CPU.
CUDA_DEVICE_TYPE = 1
#: Runtime / driver API calls during which the host waits for GPU work (runtime and driver names).
SYNC_CALLS = frozenset((
    "cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize",
    "cuCtxSynchronize", "cuStreamSynchronize", "cuEventSynchronize",
))
#: Name prefixes of memory operations (as Kineto names memcpys and memsets); other GPU ops are kernels.
MEMORY_OP_PREFIXES = ("Memcpy", "Memset")


def is_sync_call(name: str) -> bool:
    """Whether a runtime / driver API call of this name blocks the host until GPU work is done."""
    return name in SYNC_CALLS


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


def _doubles() -> array:
    return array("d")


def _ints() -> array:
    return array("q")


@dataclass
class TraceData:
    """What the report needs from one trace file, kept in compact arrays.

    ``ranges`` holds every CPU range (name, pid, tid, start_us, end_us); the prefix filter is applied
    later so one load serves any ``--prefix``. GPU op names are ids into ``names``.
    """

    path: str
    rank: int | None = None
    ranges: list = field(default_factory=list)
    launch_pid: array = field(default_factory=_ints)
    launch_ts_us: array = field(default_factory=_doubles)
    launch_correlation: array = field(default_factory=_ints)
    gpu_correlation: array = field(default_factory=_ints)
    gpu_start_us: array = field(default_factory=_doubles)
    gpu_end_us: array = field(default_factory=_doubles)
    gpu_name: array = field(default_factory=_ints)
    gpu_stream: array = field(default_factory=_ints)
    names: list = field(default_factory=list)
    sync_pid: array = field(default_factory=_ints)
    sync_start_us: array = field(default_factory=_doubles)
    sync_end_us: array = field(default_factory=_doubles)
    #: (pid, device_type, device_id) -> samples
    memory: dict = field(default_factory=dict)
    span_start_us: float = float("inf")
    span_end_us: float = float("-inf")
    bad: BadEvents = field(default_factory=BadEvents)
    """Events skipped by the source or by :func:`collect`, by reason."""
    notes: list = field(default_factory=list)
    """Warnings about the file's metadata (``("note", text)`` META tuples: a ``distributedInfo.rank`` not used)."""
    ops: OpCalls = field(default_factory=OpCalls)
    """Host operator calls (``cpu_op``), bounded (:class:`traces.operators.OpCalls`); empty for sources without."""

    @property
    def span_us(self) -> float:
        """Length of the profiled window: first to last timestamp of the kept events."""
        return max(0.0, self.span_end_us - self.span_start_us)

    @property
    def has_gpu(self) -> bool:
        """Whether the trace recorded any GPU activity."""
        return len(self.gpu_start_us) > 0


class _Collector:
    """Appends the tuples of one file to a :class:`TraceData` (one method per kind)."""

    def __init__(self, path: str):
        self.data = TraceData(path=path)
        self.lo, self.hi = self.data.span_start_us, self.data.span_end_us
        self._name_ids: dict[str, int] = {}

    def extend(self, start: float, end: float) -> None:
        self.lo, self.hi = min(self.lo, start), max(self.hi, end)

    def timed(self, ev, ts, dur=0.0) -> bool:
        """Whether ``ts`` and ``dur`` are plausible (``0 <= dur <= MAX_DUR_US``, ``|ts| <= MAX_TS_US``: finite too);
        else ``ev`` is a bad event."""
        if 0.0 <= dur <= MAX_DUR_US and -MAX_TS_US <= ts <= MAX_TS_US:
            return True
        self.reject(ev, time_reason(ts, dur))
        return False

    def reject(self, ev, reason: str) -> None:
        """Count ``ev`` as a bad event (and drop whatever part of it was appended)."""
        self.realign()
        try:
            kind = ev[0]
            name = ev[1] if kind in (RANGE, OP) else ev[5] if kind == GPU else _KIND_NAMES.get(kind)
            ts = ev[4] if kind in (RANGE, OP) else ev[3] if kind in (LAUNCH, SYNC) else ev[2]
        except (TypeError, IndexError, KeyError):
            name = ts = None
        self.data.bad.add(reason, example(name, ts))

    def realign(self) -> None:
        """Cut parallel arrays back to a common length (after a tuple failed half-way)."""
        d = self.data
        groups = [(d.gpu_correlation, d.gpu_start_us, d.gpu_end_us, d.gpu_name, d.gpu_stream),
                  (d.launch_pid, d.launch_ts_us, d.launch_correlation),
                  (d.sync_pid, d.sync_start_us, d.sync_end_us)]
        groups += [(m.ts_us, m.allocated_bytes, m.reserved_bytes) for m in d.memory.values()]
        for group in groups:
            n = min(len(a) for a in group)
            for a in group:
                del a[n:]

    def range_(self, ev) -> None:
        _, name, pid, tid, start, dur = ev
        if self.timed(ev, start, dur):
            self.data.ranges.append((printable(name), pid, tid, start, start + dur))
            self.extend(start, start + dur)

    def gpu(self, ev) -> None:
        d, name = self.data, ev[5] if len(ev) > 5 else ""
        if not self.timed(ev, ev[2], ev[3]):
            return
        name_id = self._name_ids.get(name)
        if name_id is None:
            name_id = self._name_ids[name] = len(d.names)
            d.names.append(printable(name))
        d.gpu_correlation.append(ev[1])
        d.gpu_start_us.append(ev[2])
        d.gpu_end_us.append(ev[2] + ev[3])
        d.gpu_name.append(name_id)
        d.gpu_stream.append(ev[6] if len(ev) > 6 and ev[6] is not None else -1)
        self.extend(ev[2], ev[2] + ev[3])

    def sync(self, ev) -> None:
        if self.timed(ev, ev[3], ev[4]):
            self.data.sync_pid.append(ev[1])
            self.data.sync_start_us.append(ev[3])
            self.data.sync_end_us.append(ev[3] + ev[4])

    def memory(self, ev) -> None:
        _, pid, ts, dev_type, dev_id, alloc, reserved = ev
        if not self.timed(ev, ts):
            return
        if alloc < 0 or reserved < 0:
            self.reject(ev, f"negative Total {'Allocated' if alloc < 0 else 'Reserved'}")
            return
        samples = self.data.memory.get((pid, dev_type, dev_id))
        if samples is None:
            samples = self.data.memory[(pid, dev_type, dev_id)] = MemorySamples()
        samples.ts_us.append(ts)
        samples.allocated_bytes.append(alloc)
        samples.reserved_bytes.append(reserved)

    def span(self, ev) -> None:
        if self.timed(ev, ev[1], ev[2]):
            self.extend(ev[1], ev[1] + ev[2])

    def meta(self, ev) -> None:
        if ev[1] == "rank" and type(ev[2]) is int and ev[2] >= 0:
            self.data.rank = ev[2]
        elif ev[1] == "note":
            self.data.notes.append(str(ev[2]))

    def bad(self, ev) -> None:
        self.data.bad.add(str(ev[1]), str(ev[2]) if len(ev) > 2 else "")

    def op(self, ev) -> None:
        _, name, pid, tid, start, dur = ev
        if not isinstance(name, str):
            raise TypeError("operator name not a string")
        if self.timed(ev, start, dur):
            self.data.ops.add(name, pid, tid, start, dur)


_KIND_NAMES = {LAUNCH: "launch", SYNC: "sync call", MEMORY: "[memory]", SPAN: "span"}
#: Errors of a tuple whose fields have the wrong types (caught per event; the file goes on).
_FIELD_ERRORS = (TypeError, ValueError, OverflowError, IndexError, KeyError)


def collect(path: str, events: Iterable[tuple]) -> TraceData:
    """Gather the event tuples of one file into a :class:`TraceData` (GPU ops and launches, the
    bulk of a trace, inline; the other kinds through :class:`_Collector`). A tuple with a
    non-finite time, a negative duration or fields of the wrong type is counted in ``bad``."""
    c = _Collector(path)
    d, names = c.data, c._name_ids
    handlers = {RANGE: c.range_, SYNC: c.sync, MEMORY: c.memory, SPAN: c.span, META: c.meta,
                BAD: c.bad, GPU: c.gpu, OP: c.op}
    g_corr, g_start, g_end = d.gpu_correlation.append, d.gpu_start_us.append, d.gpu_end_us.append
    g_name, g_stream = d.gpu_name.append, d.gpu_stream.append
    l_pid, l_ts, l_corr = d.launch_pid.append, d.launch_ts_us.append, d.launch_correlation.append
    lo, hi = d.span_start_us, d.span_end_us
    for ev in events:
        try:
            kind = ev[0]
            if kind == GPU and len(ev) == 7:
                _, corr, ts, dur, _device, name, stream = ev
                end = ts + dur
                if not (0.0 <= dur <= MAX_DUR_US and -MAX_TS_US <= ts <= MAX_TS_US):
                    c.reject(ev, time_reason(ts, dur))
                    continue
                name_id = names.get(name)
                if name_id is None:
                    name_id = names[name] = len(d.names)
                    d.names.append(printable(name))
                g_corr(corr), g_stream(stream if stream is not None else -1), g_start(ts), g_end(end)
                g_name(name_id)
                lo, hi = (ts if ts < lo else lo), (end if end > hi else hi)
            elif kind == LAUNCH:
                if -MAX_TS_US <= ev[3] <= MAX_TS_US:
                    l_pid(ev[1]), l_corr(ev[4]), l_ts(ev[3])
                else:
                    c.reject(ev, time_reason(ev[3]))
            else:
                handlers[kind](ev)
        except _FIELD_ERRORS as exc:
            c.reject(ev, f"fields of the wrong type ({type(exc).__name__})")
    d.span_start_us, d.span_end_us = min(lo, c.lo), max(hi, c.hi)
    return d

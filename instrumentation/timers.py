"""Stage timers: host time, device time and per-stage peak memory of each stage call.

One process-wide hub (:data:`HUB`) keeps the stack of open stage frames and the *sinks* that want
the finished records (a profiler session's recorded step, a ``collect_stages`` block). A range opens
a frame only while at least one sink is registered, so steps that nobody records pay nothing here.

* Host time: ``time.perf_counter`` around the stage body.
* Device time: a pair of CUDA events per stage call, resolved when a sink summarises (at step end),
  never synchronised per stage. On CPU the device is the CPU, so device time equals host time.
* Peak memory (CUDA only, else None): each tracked frame resets the allocator's peak on entry. To keep
  a parent's peak correct, the parent first folds the peak reached so far into its own frame; on exit
  a child folds its peak into the parent. Peaks are reset only while a sink allows it (recorded steps,
  or a ``collect_stages`` block outside any profiler session).

The frame stack is process-wide: call ``stage()`` from the training thread (ranges opened by other
threads at the same time would interleave with it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional, Protocol

from instrumentation import state

BYTES_PER_MIB = 1024 * 1024


class TimerBackend(Protocol):
    """Device clock and allocator access; :class:`CpuBackend` and :class:`CudaBackend` implement it."""

    tracks_memory: bool
    has_device_clock: bool

    def mark(self) -> Any: ...
    def elapsed_ms(self, start: Any, end: Any) -> Optional[float]: ...
    def is_done(self, mark: Any) -> bool: ...
    def release(self, marks) -> None: ...
    def max_allocated_bytes(self) -> Optional[int]: ...
    def reset_peak(self) -> None: ...


class CpuBackend:
    """No device clock (device time = host time) and no allocator peak."""

    tracks_memory = False
    has_device_clock = False

    def mark(self):
        return None

    def is_done(self, mark) -> bool:
        return True

    def release(self, marks) -> None:
        pass

    def elapsed_ms(self, start, end):
        return None

    def max_allocated_bytes(self):
        return None

    def reset_peak(self):
        pass


class CudaBackend:
    """CUDA events on the current stream; peak of the current device's caching allocator.

    The peak is read from ``torch._C._cuda_memoryStats`` directly: the public
    ``torch.cuda.max_memory_allocated()`` flattens every allocator statistic into a Python dict on
    each call (~80 us on an H200 host, against ~10 us); the public API is the fallback.
    """

    tracks_memory = True
    has_device_clock = True

    def __init__(self):
        import torch

        self._torch = torch
        self._device = torch.cuda.current_device
        self._raw_stats = getattr(torch._C, "_cuda_memoryStats", None)
        self._raw_reset = getattr(torch._C, "_cuda_resetPeakMemoryStats", None)
        self._raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        self._streams: dict[tuple[int, int], Any] = {}
        self._pool: dict[int, list] = {}
        """Released events per device, reused by :meth:`mark` (no event creation per stage call)."""

    def _current_stream(self):
        """``torch.cuda.current_stream()``, cached by raw stream handle (it builds a new Python
        object per call, ~5 us, twice per stage)."""
        if self._raw_stream is None:
            return self._torch.cuda.current_stream()
        key = (self._device(), self._raw_stream(self._device()))
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = self._torch.cuda.current_stream()
        return stream

    def mark(self):
        device = self._device()
        pool = self._pool.get(device)
        event = pool.pop() if pool else self._torch.cuda.Event(enable_timing=True)
        event.record(self._current_stream())
        event.opsd_device = device  # where it may be recorded again (see release)
        return event

    def elapsed_ms(self, start, end):
        end.synchronize()
        return start.elapsed_time(end)

    def is_done(self, mark) -> bool:
        """Whether the GPU has passed ``mark`` (``cudaEventQuery``; never waits)."""
        return mark is None or mark.query()

    def release(self, marks) -> None:
        """Give resolved events back for reuse (only once nothing reads them any more)."""
        for event in marks:
            device = getattr(event, "opsd_device", None)
            if device is not None:
                self._pool.setdefault(device, []).append(event)

    def max_allocated_bytes(self):
        if self._raw_stats is not None:
            try:
                return self._raw_stats(self._device())["allocated_bytes"]["all"]["peak"]
            except (KeyError, TypeError, RuntimeError):
                self._raw_stats = None
        return self._torch.cuda.max_memory_allocated()

    def reset_peak(self):
        if self._raw_reset is not None:
            try:
                return self._raw_reset(self._device())
            except (TypeError, RuntimeError):
                self._raw_reset = None
        self._torch.cuda.reset_peak_memory_stats()


def detect_backend() -> TimerBackend:
    """:class:`CudaBackend` when CUDA is available, else :class:`CpuBackend`."""
    import torch

    return CudaBackend() if torch.cuda.is_available() else CpuBackend()


@dataclass
class StageRecord:
    """One finished stage call."""

    stage: str
    host_ms: float
    events: Optional[tuple[Any, Any]]
    """(start, end) device events, or None on CPU."""
    peak_bytes: Optional[int]
    """Peak allocated bytes during the call, or None when memory was not tracked."""
    resolved_device_ms: Optional[float] = None

    def device_ms(self, backend: TimerBackend) -> float:
        """Device time (resolving the events once); host time when there are no events."""
        if self.events is None:
            return self.host_ms
        if self.resolved_device_ms is None:
            self.resolved_device_ms = backend.elapsed_ms(*self.events)
        return self.resolved_device_ms


class _Frame:
    __slots__ = ("stage", "sinks", "track_memory", "peak_bytes", "start_event", "t0")

    def __init__(self, stage: str, sinks: tuple, track_memory: bool):
        self.stage = stage
        self.sinks = sinks
        self.track_memory = track_memory
        self.peak_bytes = 0
        self.start_event = None
        self.t0 = 0.0


class StageTimers:
    """The frame stack and the registered sinks (one per process: :data:`HUB`)."""

    def __init__(self, backend: Optional[TimerBackend] = None):
        self._backend = backend
        self.sinks: list = []
        self.frames: list[_Frame] = []
        self.num_sessions = 0
        """Open profiler sessions; a ``collect_stages`` block inside one does not reset peaks."""
        self.track_memory = False

    @property
    def backend(self) -> TimerBackend:
        if self._backend is None:
            self._backend = detect_backend()
        return self._backend

    def add_sink(self, sink) -> None:
        """Start sending records to ``sink`` (needs ``add(record)`` and ``allows_reset``)."""
        self.sinks.append(sink)
        self._refresh()

    def remove_sink(self, sink) -> None:
        if sink in self.sinks:
            self.sinks.remove(sink)
        self._refresh()

    def _refresh(self) -> None:
        self.track_memory = self.backend.tracks_memory and any(s.allows_reset for s in self.sinks)

    def _memory_parent(self) -> Optional[_Frame]:
        for frame in reversed(self.frames):
            if frame.track_memory:
                return frame
        return None

    def open(self, stage: str) -> _Frame:
        """Open a frame for ``stage`` (call only while ``self.sinks`` is non-empty)."""
        backend = self.backend
        frame = _Frame(stage, tuple(self.sinks), self.track_memory)
        if frame.track_memory:
            parent = self._memory_parent()
            if parent is not None:
                parent.peak_bytes = max(parent.peak_bytes, backend.max_allocated_bytes())
            backend.reset_peak()
        frame.start_event = backend.mark()
        self.frames.append(frame)
        frame.t0 = time.perf_counter()
        return frame

    def close(self, frame: _Frame) -> StageRecord:
        """Close ``frame`` and hand its record to the sinks that were open at its start and still are."""
        host_ms = (time.perf_counter() - frame.t0) * 1e3
        backend = self.backend
        end_event = backend.mark() if frame.start_event is not None else None
        if self.frames and self.frames[-1] is frame:
            self.frames.pop()
        elif frame in self.frames:
            self.frames.remove(frame)
        peak = None
        if frame.track_memory:
            peak = max(frame.peak_bytes, backend.max_allocated_bytes())
            parent = self._memory_parent()
            if parent is not None:
                parent.peak_bytes = max(parent.peak_bytes, peak)
        events = None if end_event is None else (frame.start_event, end_event)
        record = StageRecord(frame.stage, host_ms, events, peak)
        for sink in frame.sinks:
            if sink in self.sinks:
                sink.add(record)
        return record

    def reset(self) -> None:
        """Drop every sink and frame (tests)."""
        self.sinks.clear()
        self.frames.clear()
        self.num_sessions = 0
        self.track_memory = False


#: The process-wide hub used by ``stage()``.
HUB = StageTimers()
state.on_configure(lambda config: None, HUB.reset)

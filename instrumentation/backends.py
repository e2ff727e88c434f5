"""Device clocks and allocator peaks for the stage timers: :class:`CpuBackend` and :class:`CudaBackend`.

:func:`detect_backend` picks one (CUDA when available); torch is imported only when it is called.
:data:`STEP_PEAKS` keeps a timed step's allocator peaks across the resets made inside it (the stage timers'
per-frame resets in mode ``1``, ``rollout.opsd.breakdown.PhaseTimer``'s per-phase resets).
"""

from __future__ import annotations

from typing import Any, Optional, Protocol


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


class StepPeaks:
    """The allocator's peaks (allocated, reserved bytes) since :meth:`begin`, across the resets made meanwhile.

    ``CudaBackend.reset_peak`` folds the peaks reached so far into it before resetting while it is active, so
    :meth:`end` returns the step's peak although the phases reset the counter. Host-side reads only (the caching
    allocator's statistics, no device sync).
    """

    def __init__(self):
        self.active = False
        self.allocated = self.reserved = 0

    def begin(self, backend) -> None:
        self.active = False
        backend.reset_peak()
        self.allocated = self.reserved = 0
        self.active = True

    def fold(self, allocated: Optional[int], reserved: Optional[int]) -> None:
        self.allocated = max(self.allocated, allocated or 0)
        self.reserved = max(self.reserved, reserved or 0)

    def end(self, backend) -> tuple[int, Optional[int]]:
        """``(peak allocated, peak reserved or None)`` since :meth:`begin`; stops folding."""
        read = getattr(backend, "peak_bytes", None)
        allocated, reserved = read() if read is not None else (backend.max_allocated_bytes(), None)
        self.fold(allocated, reserved)
        self.active = False
        return self.allocated, (self.reserved if reserved is not None else None)


#: The process's step peaks (one profiler session times steps at a time).
STEP_PEAKS = StepPeaks()


class CpuBackend:
    """No device clock (device time = host time) and no allocator peak."""

    tracks_memory = False
    has_device_clock = False

    def mark(self): return None
    def is_done(self, mark) -> bool: return True
    def release(self, marks) -> None: pass
    def elapsed_ms(self, start, end): return None
    def max_allocated_bytes(self): return None
    def reset_peak(self): pass


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

    def peak_bytes(self) -> tuple[int, int]:
        """``(peak allocated, peak reserved)`` bytes since the last reset (one statistics read)."""
        if self._raw_stats is not None:
            try:
                stats = self._raw_stats(self._device())
                return stats["allocated_bytes"]["all"]["peak"], stats["reserved_bytes"]["all"]["peak"]
            except (KeyError, TypeError, RuntimeError):
                self._raw_stats = None
        return self._torch.cuda.max_memory_allocated(), self._torch.cuda.max_memory_reserved()

    def reset_peak(self):
        if STEP_PEAKS.active:  # a timed step's peak survives the resets made inside it
            STEP_PEAKS.fold(*self.peak_bytes())
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

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

Run coalescing (light mode; the rule in full in :mod:`instrumentation.light`): while every sink has
``coalesce_runs``, consecutive calls of a stage under one parent, nothing opened or closed between
them, make ONE record of ``calls`` calls: host times summed, device time the span from the first
call's start event to the last call's end event. A run is held until anything else happens.

A stage opened while it is open already (a loop wrapped in ``stage(STEP)`` around ``OPSDStep.step``, which
opens ``opsd/step`` itself) opens no frame: it is timed once, as the outer call, with one ``ProfilingWarning``
per stage naming it and the rank (else the table would count each step twice and halve every share).

The frame stack is process-wide: call ``stage()`` from the training thread (ranges opened by other
threads at the same time would interleave with it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

from instrumentation import stages, state
from instrumentation.backends import STEP_PEAKS, CpuBackend, CudaBackend, TimerBackend, detect_backend  # noqa: F401

BYTES_PER_MIB = 1024 * 1024


@dataclass
class StageRecord:
    """One finished stage call, or a coalesced run of ``calls`` calls (see the module docstring)."""

    stage: str
    host_ms: float
    events: Optional[tuple[Any, Any]]
    """(start, end) device events, or None on CPU (of a run: first call's start, last call's end)."""
    peak_bytes: Optional[int]
    """Peak allocated bytes during the call(s), or None when memory was not tracked."""
    resolved_device_ms: Optional[float] = None
    calls: int = 1  # the stage calls it stands for (> 1: a coalesced run; host_ms is their sum)
    parent: Optional[str] = None
    """The stage of the innermost timed frame open around it (None at the top): a run's calls share it."""

    def device_ms(self, backend: TimerBackend) -> float:
        """Device time (resolving the events once); host time when there are no events."""
        if self.events is None:
            return self.host_ms
        if self.resolved_device_ms is None:
            self.resolved_device_ms = backend.elapsed_ms(*self.events)
        return self.resolved_device_ms


class _Frame:
    __slots__ = ("stage", "sinks", "track_memory", "peak_bytes", "start_event", "t0", "run")

    def __init__(self, stage: str, sinks: tuple, track_memory: bool):
        self.stage, self.sinks, self.track_memory = stage, sinks, track_memory
        self.peak_bytes, self.start_event, self.t0, self.run = 0, None, 0.0, None  # run: what it extends


class StageTimers:
    """The frame stack and the registered sinks (one per process: :data:`HUB`)."""

    def __init__(self, backend: Optional[TimerBackend] = None):
        self._backend = backend
        self.sinks: list = []
        self.frames: list[_Frame] = []
        self.num_sessions = 0
        """Open profiler sessions; a ``collect_stages`` block inside one does not reset peaks."""
        self.track_memory = self.coalesce = False  # coalesce: every sink has ``coalesce_runs``
        self._sink_tuple: tuple = ()  # tuple(self.sinks), shared by the frames opened meanwhile
        self._held: Optional[StageRecord] = None  # the run the next call of its stage may extend
        self._nested_warned: set = set()  # stages found nested in themselves (warned once each)

    @property
    def backend(self) -> TimerBackend:
        if self._backend is None:
            self._backend = detect_backend()
        return self._backend

    def add_sink(self, sink) -> None:
        """Send records to ``sink`` (``add(record)``, ``allows_reset``, optional ``coalesce_runs``)."""
        self.flush()
        self.sinks.append(sink)
        self._refresh()

    def remove_sink(self, sink) -> None:
        self.flush()
        if sink in self.sinks:
            self.sinks.remove(sink)
        self._refresh()

    def _refresh(self) -> None:
        self.track_memory = self.backend.tracks_memory and any(s.allows_reset for s in self.sinks)
        self.coalesce = bool(self.sinks) and all(getattr(s, "coalesce_runs", False) for s in self.sinks)
        self._sink_tuple = tuple(self.sinks)

    def _deliver_held(self) -> None:
        record, self._held = self._held, None
        for sink in self.sinks:  # a run's sinks are the current ones: a change of sinks flushes first
            sink.add(record)

    def flush(self) -> None:
        """End every run: deliver the held one, and those of open calls up to now (such a call is then
        timed on its own). Call it before reading a coalescing sink's records (``add/remove_sink`` do)."""
        if self._held is not None:
            self._deliver_held()
        for frame in self.frames:  # outer first: records reach the sinks in the order of their ends
            run, frame.run = frame.run, None
            if run is not None:
                if run.events is not None:
                    previous, run.events = run.events[1], (run.events[0], self.backend.mark())
                    self.backend.release((previous,))
                    frame.start_event = self.backend.mark()
                self._held = run
                self._deliver_held()

    def _memory_parent(self) -> Optional[_Frame]:
        for frame in reversed(self.frames):
            if frame.track_memory:
                return frame
        return None

    def open(self, stage: str) -> Optional[_Frame]:
        """Open a frame for ``stage`` (call only while ``self.sinks`` is non-empty); None, with one warning
        per stage, when ``stage`` is open already: a stage nested in itself is timed once, as the outer call."""
        for frame in self.frames:
            if frame.stage == stage:
                self._nested(stage)
                return None
        backend = self.backend
        held = self._held
        if held is not None and held.stage != stage:
            self._deliver_held()
        frame = _Frame(stage, self._sink_tuple, self.track_memory)
        if frame.track_memory:
            parent = self._memory_parent()
            if parent is not None:
                parent.peak_bytes = max(parent.peak_bytes, backend.max_allocated_bytes())
            backend.reset_peak()
        if self._held is None:
            frame.start_event = backend.mark()
        else:  # the held run's next call: nothing opened or closed since its last call closed
            self._held, frame.run = None, held
            frame.start_event = None if held.events is None else held.events[0]
        self.frames.append(frame)
        frame.t0 = time.perf_counter()
        return frame

    def _nested(self, stage: str) -> None:
        if stage in self._nested_warned:
            return
        self._nested_warned.add(stage)
        warn_nested(stage)

    def close(self, frame: _Frame) -> StageRecord:
        """Close ``frame`` and hand its record to the sinks that were open at its start and still are
        (while coalescing: held first, or added to the run the frame extends)."""
        host_ms = (time.perf_counter() - frame.t0) * 1e3
        backend = self.backend
        end_event = backend.mark() if frame.start_event is not None else None
        if self._held is not None:  # any close ends the held run (a child's, or out of order)
            self._deliver_held()
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
        run, frame.run = frame.run, None
        if run is not None:  # this call extends the run, held again
            run.calls, run.host_ms, self._held = run.calls + 1, run.host_ms + host_ms, run
            run.peak_bytes = run.peak_bytes if peak is None else max(run.peak_bytes or 0, peak)
            if end_event is not None:  # the previous end, referenced by nothing now, goes to the pool
                previous, run.events = run.events[1], (run.events[0], end_event)
                backend.release((previous,))
            return run
        events = None if end_event is None else (frame.start_event, end_event)
        parent = self.frames[-1].stage if self.frames else None
        record = StageRecord(frame.stage, host_ms, events, peak, parent=parent)
        if self.coalesce and frame.sinks is self._sink_tuple:
            self._held = record
            return record
        for sink in frame.sinks:
            if sink in self.sinks:
                sink.add(record)
        return record

    def reset(self) -> None:
        """Drop every sink, frame and held run, and stop folding step peaks (tests)."""
        self.__init__(self._backend)
        STEP_PEAKS.active = False


def warn_nested(stage: str) -> None:
    """One warning per stage (and process) that ``stage`` was opened inside itself."""
    name = stages.range_name(stage)
    state.warn_once(f"nested {stage}", f"stage {name} opened inside {name} (rank {_rank()}): the inner call is "
                                       "not timed (counted once, as the outer call); wrap a stage once "
                                       "(OPSDStep.step opens opsd/step itself: docs/profiling.md)")


def _rank() -> str:
    """This process's rank for a warning (``?`` when it cannot be told)."""
    try:
        from instrumentation.runfiles import resolve_rank

        return str(resolve_rank()[0])
    except Exception:  # noqa: BLE001 - a warning never fails
        return "?"


#: The process-wide hub used by ``stage()``.
HUB = StageTimers()
state.on_configure(lambda config: None, HUB.reset)

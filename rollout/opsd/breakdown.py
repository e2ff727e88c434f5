"""Where one OPSD step's time and memory went: per-phase host and device times, peak memory.

:class:`PhaseTimer` times each phase call of a step (rollout, teacher forward, logit cache, student
forward, loss, backward, optimizer step; the middle five once per micro-batch) and sums them per
phase. Host times are ``time.perf_counter`` spans. Device times come from a pair of CUDA events per
call, read after the step's last host sync (the loss value), so the timer adds no sync of its own.
Peak memory (CUDA) is the allocator's peak within each call: the timer resets the peak counter when a
call starts, except while a profiler session's stage timers own that counter (a recorded step),
where the peaks are left to the profiler's per-stage table and reported as None here.
Each phase (but the rollout, whose range the rollout opens itself) also opens its ``opsd/<stage>``
range, so the breakdown and the profiler see the same boundaries.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Optional

from instrumentation import stage, stages
from instrumentation.timers import HUB, detect_backend

#: The phases of a step, in order (stage names of :mod:`instrumentation.stages`).
PHASES = (stages.ROLLOUT, stages.TEACHER_FORWARD, stages.LOGIT_CACHE, stages.STUDENT_FORWARD,
          stages.LOSS, stages.BACKWARD, stages.OPTIMIZER_STEP)
_LABELS = {stages.ROLLOUT: "rollout", stages.TEACHER_FORWARD: "teacher fwd", stages.LOGIT_CACHE: "cache",
           stages.STUDENT_FORWARD: "student fwd", stages.LOSS: "loss", stages.BACKWARD: "backward",
           stages.OPTIMIZER_STEP: "optimizer"}
GIB = float(1 << 30)


@dataclass(frozen=True)
class PhaseTimes:
    """One figure per phase of a step: milliseconds (totals over micro-batches) or GiB (peaks)."""

    rollout: Optional[float]
    """The rollout (None when the step had none: :meth:`OPSDStep.train_on_batch`)."""
    teacher_forward: float
    """Teacher forwards (no grad)."""
    logit_cache: float
    """Building the teacher logit cache from the teacher's logits."""
    student_forward: float
    """Student forwards (with grad)."""
    loss: float
    """The distillation loss (and its gradient buffer)."""
    backward: float
    """Backward passes (``engine.backward`` / ``loss.backward``)."""
    optimizer_step: float
    """The optimizer step (``engine.step`` / ``optimizer.step``)."""

    def values(self) -> tuple[float, ...]:
        """The phases' figures in step order (0.0 for a rollout that did not happen)."""
        return tuple(getattr(self, name) or 0.0 for name in PHASES)

    def total(self) -> float:
        """Sum over the phases (for times)."""
        return sum(self.values())

    def peak(self) -> float:
        """Largest figure over the phases (for peaks)."""
        return max(self.values())


@dataclass(frozen=True)
class StepBreakdown:
    """What each phase of one step took, and how the rows were micro-batched."""

    host_ms: PhaseTimes
    """Host wall time per phase (asynchronous GPU work shows where the host waits for it)."""
    device_ms: Optional[PhaseTimes]
    """GPU time per phase from CUDA events (None on the CPU)."""
    peak_gib: Optional[PhaseTimes]
    """Peak allocated GiB per phase (None on the CPU and in steps a profiler session records)."""
    num_micro_batches: int
    """Student micro-batches (forward + loss + backward each)."""
    max_micro_batch_rows: int
    """Rows of the largest micro-batch."""
    num_teacher_forwards: int
    """Teacher forwards."""
    budget_gib: Optional[float]
    """Memory budget of one micro-batch (``max_student_rows="auto"``; None otherwise)."""
    train_path: str = "padded"
    """How the teacher and student passes ran: ``"packed"`` or ``"padded"`` (``OPSDConfig.train_path``)."""
    teacher_path: str = "padded"
    """The teacher's forward: ``"fast"`` (the rollout's decoder pieces), ``"hf"`` (HF's forward, packed) or
    ``"padded"``."""
    student_path: str = "padded"
    """The student's forward and backward: ``"fast"`` (the rollout's decoder pieces with autograd), ``"hf"`` (HF's
    forward, packed) or ``"padded"``."""
    max_micro_batch_tokens: int = 0
    """Tokens of the largest student micro-batch as computed (packed: real tokens; padded: rows x columns)."""
    rollout_path: str = ""
    """How the step's rollout ran (:func:`rollout_path`): its route, prefill and decode paths, and why it decoded
    through HF's layers where it did; "" for a step without a rollout."""

    def lines(self) -> list[str]:
        """The breakdown as text: times per phase, then the micro-batching and peak memory."""
        times, clock = (self.device_ms, "GPU") if self.device_ms is not None else (self.host_ms, "host")
        parts = [f"{_LABELS[name]} {getattr(times, name):.1f}" for name in PHASES
                 if getattr(times, name) is not None]
        budget = "" if self.budget_gib is None else f" (budget {self.budget_gib:.3g} GiB)"
        shape = (f"{self.train_path} (teacher {self.teacher_path}, student {self.student_path}): "
                 f"{self.num_micro_batches} micro-batches of <= {self.max_micro_batch_rows} rows "
                 f"and <= {self.max_micro_batch_tokens} tokens{budget}, {self.num_teacher_forwards} teacher forwards")
        if self.peak_gib is not None:
            peaks = ", ".join(f"{_LABELS[name]} {getattr(self.peak_gib, name):.2f}" for name in PHASES
                              if getattr(self.peak_gib, name) is not None)
            shape += f"; peak GiB {self.peak_gib.peak():.2f} ({peaks})"
        lines = [f"phases ms ({clock}): " + " | ".join(parts), shape]
        return lines + ([f"rollout: {self.rollout_path}"] if self.rollout_path else [])


def rollout_path(stats) -> str:
    """One line of a call's :class:`rollout.stats.CallStats`: ``ordinary route, prefill packed, decode graph``;
    where the decode ran other than from CUDA graphs, the reason too (a slow path a user should see: HF's layers, a
    failed graph capture, graphs turned off or not on this device)."""
    text = f"{stats.route} route, prefill {stats.prefill.path}, decode {stats.decode.path}"
    if stats.decode.path != "graph" and stats.decode.fallback_reason:
        text += f" ({stats.decode.fallback_reason})"
    return text


class PhaseTimer:
    """Times the phases of one step (see the module docstring); one per step."""

    def __init__(self, backend=None):
        self._backend = detect_backend() if backend is None else backend
        self._host = dict.fromkeys(PHASES, 0.0)
        self._events: dict[str, list] = {name: [] for name in PHASES}
        self._peaks: dict[str, int] = {}
        self._ran: set[str] = set()
        self._tracks_peaks = self._backend.tracks_memory and not HUB.track_memory

    @contextlib.contextmanager
    def phase(self, name: str, *, opens_range: bool = True):
        """Time one call of phase ``name``; opens its ``opsd/<name>`` range unless told not to."""
        backend, tracks_peaks = self._backend, self._tracks_peaks and not HUB.track_memory
        self._tracks_peaks = tracks_peaks
        with stage(name) if opens_range else contextlib.nullcontext():
            if tracks_peaks:
                backend.reset_peak()
            start = backend.mark() if backend.has_device_clock else None
            began = time.perf_counter()
            try:
                yield
            finally:
                self._host[name] += (time.perf_counter() - began) * 1e3
                self._ran.add(name)
                if start is not None:
                    self._events[name].append((start, backend.mark()))
                if tracks_peaks:
                    self._peaks[name] = max(self._peaks.get(name, 0), backend.max_allocated_bytes())

    def _times(self, values: dict) -> PhaseTimes:
        return PhaseTimes(**{name: (values[name] if name in self._ran else (None if name == stages.ROLLOUT else 0.0))
                             for name in PHASES})

    def _device_ms(self) -> Optional[PhaseTimes]:
        if not self._backend.has_device_clock:
            return None
        totals = {}
        for name, pairs in self._events.items():
            totals[name] = sum(self._backend.elapsed_ms(start, end) for start, end in pairs)
            self._backend.release([event for pair in pairs for event in pair])
            pairs.clear()
        return self._times(totals)

    def breakdown(self, num_micro_batches: int, max_rows: int, num_teacher_forwards: int,
                  budget_bytes: Optional[float], *, train_path: str = "padded", teacher_path: str = "padded",
                  student_path: str = "padded", max_tokens: int = 0, rollout: str = "") -> StepBreakdown:
        """The step's :class:`StepBreakdown`; call after the step's last host sync (no wait then)."""
        peaks = None
        if self._tracks_peaks:
            peaks = self._times({name: self._peaks.get(name, 0) / GIB for name in PHASES})
        budget = None if budget_bytes is None else budget_bytes / GIB
        return StepBreakdown(self._times(self._host), self._device_ms(), peaks, num_micro_batches, max_rows,
                             num_teacher_forwards, budget, train_path, teacher_path, student_path, max_tokens,
                             rollout)

"""Timed steps whose device times are resolved later, so that timing never makes the host wait.

In mode ``timers`` every timed step's stage records (host time and a pair of CUDA events per stage
call) are queued at the end of the step. A queued step is resolved when its last event has completed
(``cudaEventQuery``, no wait): usually at the next step's end, since the GPU has finished the step by
then. Only when more than ``max_pending`` steps are waiting, or when the session ends, does the oldest
one wait for its events (one ``cudaEventSynchronize``). Resolved events go back to the backend's pool.
"""

from __future__ import annotations

from collections import deque

from instrumentation.collect import summarize
from instrumentation.timers import StageRecord, TimerBackend


class PendingSteps:
    """See the module docstring."""

    def __init__(self, backend: TimerBackend, max_pending: int = 2):
        if max_pending < 0:
            raise ValueError(f"max_pending must be >= 0; got {max_pending}")
        self.backend = backend
        self.max_pending = max_pending
        self._steps: deque = deque()

    def __len__(self) -> int:
        return len(self._steps)

    def add(self, step: int, records: list[StageRecord], wall_ms: float) -> None:
        self._steps.append((step, records, wall_ms))

    def _done(self, records: list[StageRecord]) -> bool:
        """Whether the last event of the step (that of the last stage call to close) has completed."""
        ends = [r.events[1] for r in records if r.events is not None]
        return not ends or self.backend.is_done(ends[-1])

    def pop_ready(self, force: bool = False) -> list[tuple[int, dict, float]]:
        """``(step, summary, wall_ms)`` of the steps that can be resolved now, oldest first."""
        out = []
        while self._steps:
            step, records, wall_ms = self._steps[0]
            if not (force or len(self._steps) > self.max_pending or self._done(records)):
                break
            self._steps.popleft()
            summary = summarize(records, self.backend)
            self.backend.release([e for r in records if r.events is not None for e in r.events])
            out.append((step, summary, wall_ms))
        return out

"""Timed steps whose device times are resolved later, so that timing never makes the host wait.

In mode ``timers`` every timed step's stage records (host time and CUDA events: one pair per run of
calls, below) are queued at the end of the step, after ``HUB.flush()`` has delivered the run still
held. A queued step is resolved when its last event has completed (``cudaEventQuery``, no wait):
usually at the next step's end, since the GPU has finished the step by then. Only when more than
``max_pending`` steps are waiting, or when the session ends, does the oldest one wait for its events
(one ``cudaEventSynchronize``). Resolved events go back to the backend's pool.

**Run coalescing** (the timers-mode step sink has ``coalesce_runs = True``;
:class:`instrumentation.timers.StageTimers` does it). Rule: consecutive calls of the same stage under
the same parent frame, with no other frame opened or closed between one call's close and the next
call's open, are timed as ONE record with one event pair:

* ``calls`` = the number of calls; reports count calls, not records (``collect.summarize``), so the
  stage table still shows e.g. 127 ``opsd/decode`` calls a step;
* ``host_ms`` = the sum of the calls' host times;
* device ms = elapsed(start event of the first call's open, end event of the last call's close): the
  SPAN of the run, which includes any GPU work or GPU idle time between the calls (e.g. sampling
  kernels launched between two ``opsd/decode`` calls are counted as decode time).

Each call after the first records only its end event (the previous end goes back to the pool), and a
run is resolved once: the ~127 decode calls of a rollout record 128 events instead of 254 and resolve
one pair instead of 127. Frames opened *inside* a call (children) are recorded on their own and do not
break the run (a single call's device time includes its children's anyway). A run ends as soon as
anything else happens: another stage opens, any frame closes (its parent, say), a sink is added or
removed, or ``HUB.flush()`` is called; so a run never spans two steps. A call still open at a flush
ends its run there (the run's span stops at that moment) and is timed on its own from then on.
Records reach a sink in the order of their end events. Nothing is coalesced while a sink without
``coalesce_runs`` is registered (``collect_stages`` blocks, mode ``1``'s recorded steps): those get one
record per call.
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
        """Whether the last event of the step (that of the last stage call to close) has completed.

        Records reach a sink in the order of their end events, coalesced runs included (a run is
        delivered before anything that closes after its last call), so the last record's is the last.
        """
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

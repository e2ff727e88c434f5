"""Which torch.profiler action each training step gets, from the set of recorded steps (no torch).

Consecutive recorded steps form one *window*: the step before a window (when it exists) warms the
profiler up, the window's steps are recorded, and its last step saves one trace. Other steps are
idle ("wait"). The result maps 1:1 onto ``torch.profiler.ProfilerAction``.
"""

from __future__ import annotations

from typing import Iterable

NONE = "none"
WARMUP = "warmup"
RECORD = "record"
RECORD_AND_SAVE = "record_and_save"


def step_windows(steps: Iterable[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive steps, as inclusive ``(first, last)`` pairs in order."""
    windows: list[tuple[int, int]] = []
    for step in sorted(set(steps)):
        if windows and step == windows[-1][1] + 1:
            windows[-1] = (windows[-1][0], step)
        else:
            windows.append((step, step))
    return windows


class WindowSchedule:
    """Callable ``step -> action`` (one of the module's constants) over the recorded windows."""

    def __init__(self, steps: Iterable[int]):
        self.windows = step_windows(steps)
        self._actions: dict[int, str] = {}
        for first, last in self.windows:
            if first > 0:
                self._actions[first - 1] = WARMUP
            for step in range(first, last):
                self._actions[step] = RECORD
            self._actions[last] = RECORD_AND_SAVE

    def __call__(self, step: int) -> str:
        return self._actions.get(step, NONE)

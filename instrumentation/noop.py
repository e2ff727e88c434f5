"""The one do-nothing object of the off path (no torch).

``stage(name)`` with profiling off, ``collect_stages()`` with timers off, and any caller that needs a
stand-in for a stage range (``with NOOP: ...``) share this single instance: entering it returns None
and exiting it never swallows an exception. Pick it once instead of testing a switch on every call.
"""

from __future__ import annotations


class Noop:
    """A reusable, re-entrant context manager that does nothing; ``__enter__`` returns None."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        return False

    def __repr__(self) -> str:
        return "instrumentation.NOOP"


#: The shared do-nothing object.
NOOP = Noop()
#: Former name of :data:`NOOP` (the off path of ``stage()``); the same object.
NOOP_RANGE = NOOP

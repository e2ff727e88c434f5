"""Bad events: skipped one by one, counted by reason, reported in one warning line per file.

A source turns an event it cannot use into a ``(BAD, reason, example)`` tuple (see
:mod:`traces.events`); :func:`traces.events.collect` also rejects tuples whose times are not finite
or implausible (beyond :data:`MAX_TS_US` / :data:`MAX_DUR_US`: ``"dur": 1e300`` would move a stage above its
step and print 300 digits) or whose duration is negative, so such values never reach a total. :class:`BadEvents` keeps the
count per reason and the first example of each; :meth:`BadEvents.describe` is the warning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

#: Kind of the tuple a source yields for an event it skipped (after the kinds of traces.events).
BAD = 7
#: Reasons named in one warning line (the others are counted together).
MAX_REASONS_SHOWN = 4
_EXAMPLE_CHARS = 60
#: Largest plausible ``|ts|``, microseconds: ~3,000 years after 1970 (Kineto's clock reads ~1.8e15 today).
MAX_TS_US = 1e17
#: Longest plausible duration, microseconds: ~11.6 days (a profiled range is seconds to minutes).
MAX_DUR_US = 1e12


class BadEvent(ValueError):
    """An event whose fields cannot be used; ``reason`` says which (``"pid not an integer"``)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def example(name, ts) -> str:
    """A short description of an event for the warning: its name and start."""
    text = repr(name) if isinstance(name, str) else f"<{type(name).__name__} name>"
    if len(text) > _EXAMPLE_CHARS:
        text = text[:_EXAMPLE_CHARS - 4] + "...'"
    if isinstance(ts, (int, float)) and not isinstance(ts, bool):
        return f"{text} at ts {float(ts)!r}"
    return text


def integer(value, what: str) -> int:
    """``value`` when it is an int (not a bool), else :class:`BadEvent`."""
    if type(value) is int:
        return value
    raise BadEvent(f"{what} not an integer")


def number(value, what: str) -> float:
    """``value`` as a float when it is a number or numeric text, else :class:`BadEvent`."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise BadEvent(f"{what} not a number")
    try:
        return float(value)
    except (ValueError, OverflowError):
        raise BadEvent(f"{what} not a number") from None


def time_reason(ts, dur=0.0) -> str:
    """Why a (start, duration) pair was refused: which value is not finite, or a negative duration."""
    if not math.isfinite(ts):
        return "non-finite ts"
    if not math.isfinite(dur):
        return "non-finite dur"
    if dur < 0:
        return "negative dur"
    if not math.isfinite(ts + dur):
        return "end beyond the largest float"
    if abs(ts) > MAX_TS_US:
        return f"implausible ts (beyond {MAX_TS_US:.0e} us)"
    if dur > MAX_DUR_US:
        return f"implausible dur (over {MAX_DUR_US:.0e} us)"
    return "implausible time"


@dataclass
class BadEvents:
    """Skipped events of one file: count per reason, and the first example of each."""

    counts: dict = field(default_factory=dict)
    examples: dict = field(default_factory=dict)

    def add(self, reason: str, first: str = "", n: int = 1) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + n
        self.examples.setdefault(reason, first)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def describe(self) -> str:
        """``skipped N bad event(s): k with <reason> (first: <example>), ...``."""
        ranked = sorted(self.counts.items(), key=lambda item: (-item[1], item[0]))
        parts = [f"{n} with {reason}" + (f" (first: {self.examples[reason]})" if self.examples[reason] else "")
                 for reason, n in ranked[:MAX_REASONS_SHOWN]]
        rest = sum(n for _, n in ranked[MAX_REASONS_SHOWN:])
        if rest:
            parts.append(f"{rest} for {len(ranked) - MAX_REASONS_SHOWN} other reasons")
        total = self.total
        return f"skipped {total} bad event{'s' if total != 1 else ''}: {', '.join(parts)}"

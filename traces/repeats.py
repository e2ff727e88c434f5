"""Ranges counted twice in one file: exact repeats, and a stage nested in itself (pure).

Both dilute every figure: the same ``opsd/step`` twice doubles the step total, so every share reads half, and
the table shows twice the steps. A range nested in another of the same name on the same thread (a loop wrapped
in ``stage(STEP)`` around ``OPSDStep.step``, which opens ``opsd/step`` itself) is the same time counted twice.
:func:`drop_repeats` keeps the outermost range of each such group (its window holds the others) and counts
what it dropped by name; ranges that follow each other (``opsd/decode`` calls) are never touched.
"""

from __future__ import annotations

from collections import Counter

from traces.compute import NEST_TOLERANCE_US


def drop_repeats(ranges: list) -> tuple[list, Counter, Counter]:
    """``(kept, repeated, nested)``: ``ranges`` (``(name, pid, tid, start, end)``, file order kept) without
    exact repeats and without ranges nested in a range of the same name on the same thread; the two
    counters count the dropped ranges by name."""
    order = sorted(range(len(ranges)), key=lambda i: (ranges[i][:3], ranges[i][3], -ranges[i][4]))
    repeated, nested, drop = Counter(), Counter(), set()
    outer = previous = None
    for i in order:
        r = ranges[i]
        if previous is not None and r == previous:
            repeated[r[0]] += 1
            drop.add(i)
        elif outer is not None and r[:3] == outer[:3] and r[3] < outer[4] and r[4] <= outer[4] + NEST_TOLERANCE_US:
            nested[r[0]] += 1
            drop.add(i)
        else:
            outer = r
        previous = r
    if not drop:
        return ranges, repeated, nested
    return [r for i, r in enumerate(ranges) if i not in drop], repeated, nested


def describe(rank, repeated: Counter, nested: Counter) -> str:
    """One warning line (after the file's path) for what :func:`drop_repeats` dropped; "" for nothing."""
    parts = [f"{n} {name!r} range{'s' if n != 1 else ''} repeated exactly" for name, n in sorted(repeated.items())]
    parts += [f"{n} {name!r} range{'s' if n != 1 else ''} nested in another {name!r}"
              for name, n in sorted(nested.items())]
    if not parts:
        return ""
    text = f"rank {rank}: {', '.join(parts)}; counted once"
    return text + (" (the outer range): wrap a stage once (docs/profiling.md)" if nested else "")

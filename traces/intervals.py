"""Interval arithmetic on numpy arrays (pure; times in any unit, intervals closed ``[start, end]``).

Every GPU figure of the report is a length of a union of intervals: busy time (union of the kernels,
copies and sets), a stage's window, the overlap of communication with computation.
"""

from __future__ import annotations

import numpy as np


def merge(starts, ends) -> tuple[np.ndarray, np.ndarray]:
    """The union of ``[starts[i], ends[i]]`` as sorted, disjoint intervals (touching ones joined)."""
    s, e = np.asarray(starts, dtype=np.float64), np.asarray(ends, dtype=np.float64)
    if len(s) == 0:
        return s, e
    order = np.argsort(s, kind="stable")
    s, e = s[order], e[order]
    reach = np.maximum.accumulate(e)
    new = np.empty(len(s), dtype=bool)
    new[0] = True
    new[1:] = s[1:] > reach[:-1]
    first = np.flatnonzero(new)
    last = np.append(first[1:] - 1, len(s) - 1)
    return s[first], reach[last]


def union_length(starts, ends) -> float:
    """Total length covered by the union of the intervals ``[starts[i], ends[i]]``."""
    s, e = merge(starts, ends)
    return float((e - s).sum())


def clip(starts, ends, lo: float, hi: float) -> tuple[np.ndarray, np.ndarray]:
    """The parts of the intervals inside ``[lo, hi]`` (empty ones dropped)."""
    s = np.maximum(np.asarray(starts, dtype=np.float64), lo)
    e = np.minimum(np.asarray(ends, dtype=np.float64), hi)
    keep = e > s
    return s[keep], e[keep]


def intersection_length(a: tuple, b: tuple) -> float:
    """Length of (union of intervals ``a``) ∩ (union of intervals ``b``); each a (starts, ends) pair."""
    both = union_length(np.concatenate((a[0], b[0])), np.concatenate((a[1], b[1])))
    return max(0.0, union_length(*a) + union_length(*b) - both)


def gaps(starts, ends, lo: float, hi: float) -> tuple[np.ndarray, np.ndarray]:
    """The parts of ``[lo, hi]`` that no interval covers, as sorted (starts, ends)."""
    s, e = merge(*clip(starts, ends, lo, hi))
    gap_s = np.concatenate(([lo], e))
    gap_e = np.concatenate((s, [hi]))
    keep = gap_e > gap_s
    return gap_s[keep], gap_e[keep]


def covered_length(starts, ends, lo: float, hi: float) -> float:
    """Length of ``[lo, hi]`` covered by the union of the intervals."""
    return union_length(*clip(starts, ends, lo, hi)) if hi > lo else 0.0

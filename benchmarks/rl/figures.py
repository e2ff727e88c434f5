"""Figures of the RL suite computed from plain data: realised lengths, GPU-busy unions, nucleus sizes, and the
geometric search that calibrates a scale (the rooflines are :mod:`instrumentation.roofline`)."""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch


def response_lengths(batch) -> list[int]:
    """Realised response lengths of a ``RolloutBatch``: the attention mask after ``response_start_idx``."""
    start = int(batch.response_start_idx[0])
    return batch.attention_mask[:, start:].ne(0).sum(dim=1).tolist()


def length_stats(lengths: list[int]) -> dict:
    """Mean, p50, p90 (nearest rank) and max of realised response lengths."""
    if not lengths:
        return {"mean": None, "p50": None, "p90": None, "max": None}
    ordered = sorted(lengths)

    def rank(q: float) -> int:
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)]

    return {"mean": sum(ordered) / len(ordered), "p50": rank(0.5), "p90": rank(0.9), "max": ordered[-1]}


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by the union of ``[start, end]`` intervals."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def busy_percent(intervals: list[tuple[float, float]], wall: float) -> Optional[float]:
    """100 * union of the GPU intervals / wall (same unit)."""
    return None if wall <= 0 else 100.0 * union_length(intervals) / wall


def nucleus_sizes(logits: torch.Tensor, top_p: float) -> list[int]:
    """Tokens kept by top-p filtering per row of ``logits [N, V]``: those whose preceding mass is < top_p."""
    probs = torch.softmax(logits.float(), dim=-1).sort(dim=-1, descending=True).values
    before = probs.cumsum(dim=-1) - probs
    return (before < top_p).sum(dim=-1).tolist()


def search_scale(probe: Callable[[float], float], target: float, max_probes: int = 12, tolerance: float = 0.1,
                 max_scale: float = 4096.0, lower: Optional[Callable[[float], float]] = None) -> tuple[float, float, list]:
    """Geometric search for s >= 1 with probe(s) ~ target, where probe decreases in s.

    Doubles s from 1 until probe(s) <= target, then bisects geometrically; stops within ``tolerance``
    (relative) or after ``max_probes`` probes. ``lower`` (optional, cheaper, lower(s) <= probe(s), e.g. the
    mean length under a smaller budget) decides the doubling steps where it already exceeds the target; the
    full probe runs only where it does not. Returns (s, probe(s), [(s, value), ...] of the full probes) for
    the full probe closest to the target.
    """
    seen: list[tuple[float, float]] = []
    num_probes = 0

    def run(s: float, fn: Callable[[float], float]) -> float:
        nonlocal num_probes
        num_probes += 1
        value = fn(s)
        if fn is probe:
            seen.append((s, value))
        return value

    def close(value: float) -> bool:
        return abs(value - target) <= tolerance * target

    def above(s: float) -> tuple[bool, float]:
        """Whether probe(s) is clearly above the target (asking ``lower`` first), and the full value if run."""
        if lower is not None and run(s, lower) > target * (1 + tolerance):
            return True, math.nan
        value = run(s, probe)
        return value > target and not close(value), value

    lo, hi = 1.0, None
    is_above, value = above(1.0)
    if is_above:
        s = 2.0
        while num_probes < max_probes and s <= max_scale:
            is_above, value = above(s)
            if not is_above:
                hi = s
                break
            lo, s = s, s * 2
    if hi is not None and not close(value):
        while num_probes < max_probes:
            mid = math.sqrt(lo * hi)
            value = run(mid, probe)
            if close(value):
                break
            lo, hi = (mid, hi) if value > target else (lo, mid)
    if not seen:  # every probe was a lower bound above the target: the largest scale tried is the best known
        seen.append((lo, run(lo, probe)))
    best = min(seen, key=lambda sv: abs(math.log(max(sv[1], 1e-9) / target)))
    return best[0], best[1], seen

"""Shape buckets of the static decode buffers and their CUDA graphs (pure Python).

Fewer distinct shapes mean fewer graph captures and fewer re-allocations: the live batch is rounded
up to a batch bucket (padding rows compute values nobody reads), attention reads the live columns
rounded up to ``LENGTH_BUCKET``.
"""

from __future__ import annotations

from rollout.checks import round_up

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
LENGTH_BUCKET = 256


def batch_bucket(num_rows: int) -> int:
    """The smallest batch bucket holding ``num_rows`` (multiples of 128 beyond the table)."""
    for size in BATCH_BUCKETS:
        if num_rows <= size:
            return size
    return round_up(num_rows, 128)


def length_round(n: int) -> int:
    """``n`` rounded up to a multiple of ``LENGTH_BUCKET`` (capacities and budgets of reusable buffers)."""
    return round_up(n, LENGTH_BUCKET)


def length_bucket(live_len: int, capacity: int) -> int:
    """Columns an ordinary-route decode step attends: the live length rounded up, within the capacity."""
    return min(capacity, length_round(live_len))


def read_window(read_start: int, front: int, capacity: int, bucket: int = LENGTH_BUCKET) -> tuple[int, int]:
    """Columns ``[start, stop)`` a continuous-route decode step reads: the live window
    ``[read_start, front + 1)`` widened to multiples of ``bucket`` (``stop`` at most ``capacity``), so few
    distinct windows exist and each reads less than ``2 * bucket`` columns beyond the live ones."""
    start = read_start // bucket * bucket
    return start, min(capacity, round_up(front + 1, bucket))

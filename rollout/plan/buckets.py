"""Shape buckets of the static decode buffers and their CUDA graphs (pure Python).

Fewer distinct shapes mean fewer graph captures and fewer re-allocations: the live batch is rounded
up to a batch bucket (padding rows compute values nobody reads), attention reads the live columns
rounded up to ``LENGTH_BUCKET``. The KV storage's own width (``storage_columns``) keeps its stride off the
multiples the GPU's memory reads slowly.
"""

from __future__ import annotations

from rollout.checks import round_up

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
LENGTH_BUCKET = 256
#: One row and KV head's columns of KV storage span an odd multiple of this many bytes (``storage_columns``).
STRIDE_UNIT_BYTES = 16384


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


def storage_columns(capacity: int, head_column_bytes: int) -> int:
    """Columns to allocate for a KV cache of ``capacity`` columns, one KV head's key (or value) column being
    ``head_column_bytes`` bytes (head dim x item size; 0: no padding): the fewest, at least ``capacity``, whose
    bytes (the stride from one row and KV head to the next) are an odd multiple of ``STRIDE_UNIT_BYTES``, where that
    adds at most an eighth; else ``capacity``. The columns past ``capacity`` are never read or written.

    On an H100 80GB HBM3 the decode attention over 256 rows (bf16, head dim 128) read 6-19% slower from a cache of
    1,280 or 2,560 columns (strides of 5 x 64 KiB and twice that) than from the other multiples of 64 columns from
    512 to 2,624, and every odd multiple of 16 KiB among them was within 2% of the best
    (docs/results/h200-2026-12-07b). The opsd cells' cache (256 prompt + 1,024 new columns) hit it: padded to
    1,344 columns, opsd-uniform ran 5.3% faster (call 3 there)."""
    if head_column_bytes <= 0 or STRIDE_UNIT_BYTES % head_column_bytes:
        return capacity
    unit = STRIDE_UNIT_BYTES // head_column_bytes
    units = -(-capacity // unit)
    padded = (units + 1 - units % 2) * unit
    return padded if 8 * padded <= 9 * capacity else capacity

"""``CacheStats``: what the KV cache of one call did, counted where it happens.

The continuous route's ``AlignedKVCache`` and the ordinary route's compaction count into the same record, which
is ``CallStats.cache`` itself: one name for each counter from the cache to the profile.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CacheStats:
    """The call's KV cache: its size and the bytes its moves wrote."""

    num_slots: int = 0
    """Rows of the KV cache the call used (a batch bucket when decoding from static buffers)."""
    capacity: int = 0
    """Columns of the KV cache the call used."""
    nbytes: int = 0
    """Bytes of that KV cache (keys + values, all layers)."""
    compactions: int = 0
    """Ordinary route: times the unfinished rows were moved into a smaller batch bucket."""
    trims: int = 0
    """Continuous route: left realigns (the dead prefix dropped because the front reached the capacity)."""
    shifts: int = 0
    """Continuous route: right realigns (room made left of the front for a longer admitted prompt)."""
    row_moves: int = 0
    """Rows copied by compaction (both routes)."""
    bytes_moved: int = 0
    """Bytes written into the cache by compaction and (continuous route) realigns (keys + values, all layers)."""
    prefill_copy_bytes: int = 0
    """Continuous route: bytes of prefilled keys/values copied from the scratch into the slots."""
    scratch_bytes: int = 0
    """Continuous route: bytes of the prefill scratch arena."""
    scratch_allocations: int = 0
    """Continuous route: allocations of the scratch arena during the call."""

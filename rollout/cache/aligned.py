"""The aligned KV cache of the continuous-batching route, and the scratch arena its prefills run in.

Layout. Per layer, keys and values live in preallocated ``[num_slots, H_kv, capacity, D]`` buffers
(one ``[L, num_slots, H_kv, capacity, D]`` tensor each) whose addresses never change. Live rows are
the prefix ``[0, num_rows)`` (the scheduler compacts them), so decode runs on a prefix batch view.
Every live row *ends* at the same physical column ``front``: a row of ``extent`` used columns
occupies ``[front - extent, front)``, its unpadded prompt right-aligned there and followed by the
tokens it has fed back. Decode writes column ``front`` of every live row and attends to
``[front - max_extent, front + 1)``; ``valid [num_slots, capacity]`` (bool, kept here) says which of
those columns hold real tokens of that row.

Invariant of ``valid``: for a live row, every column outside ``[front - extent, front)`` is False
(refills reset the whole row; moves copy whole rows; ``realign`` rebuilds the rows), so one window
``[front - max_extent, front + 1)`` serves every row. Columns outside a row's span may hold stale
keys and values: always finite (they come from real forwards), and masked out.

Positions are not columns: rotary embeddings are applied before keys reach the cache, so moving a
row's columns never changes what it attends to; the runner feeds each row its own position ids.

Operations (each counts the bytes it writes into the cache):

- ``write_prompts``: copy a bucket's prefilled keys/values from a scratch cache into freshly
  admitted rows, right-aligned to end at ``front`` (shared prefill: one bucket row -> n slots);
- ``move_rows``: compaction, the scheduler's ``(src, dst)`` row copies over the live window;
- ``realign``: move the live block so the front lands on another column: left ("trim" of the dead
  prefix when the front reaches the capacity) or right (room for a longer admitted prompt).
"""

from __future__ import annotations

import torch

from rollout.cache.static import CacheShape, OwnedKVLayer, StaticKVCache
from rollout.cache.stats import CacheStats
from rollout.model.compat import Cache


class AlignedKVCache(Cache):
    """Keys/values of every layer in two preallocated tensors ``[L, num_slots, H_kv, capacity, D]``.

    ``shape.batch_size`` is the number of slots. ``storage`` (e.g. a ``CachePool`` allocation) may be
    larger in both the batch and the column dimension; this cache uses its leading part.
    """

    def __init__(self, shape: CacheShape, storage: tuple[torch.Tensor, torch.Tensor] | None = None,
                 state: tuple[torch.Tensor, torch.Tensor] | None = None):
        """``state``: ``(valid [slots, capacity] bool, write_col [1] int64)`` to use instead of fresh ones
        (the static buffers of the continuous route's CUDA graphs, :mod:`rollout.executors.continuous.buffers`)."""
        dims = (shape.num_layers, shape.batch_size, shape.num_kv_heads, shape.capacity, shape.head_dim)
        if storage is None:  # a new one is padded where the stride matters (CacheShape.storage_columns)
            storage = shape.new_storage()
        keys, values = storage
        if keys.dim() != 5 or any(have < need for have, need in zip(keys.shape, dims)) \
                or (keys.shape[0], keys.shape[2], keys.shape[4]) != (dims[0], dims[2], dims[4]):
            raise ValueError(f"storage: shape {tuple(keys.shape)} cannot hold {dims}")
        self.shape = shape
        self.key_storage = keys[:, :shape.batch_size, :, :shape.capacity]
        self.value_storage = values[:, :shape.batch_size, :, :shape.capacity]
        super().__init__(layers=[OwnedKVLayer(self, self.key_storage[i], self.value_storage[i])
                                 for i in range(shape.num_layers)])
        if state is None:
            self.valid = torch.zeros((shape.batch_size, shape.capacity), dtype=torch.bool, device=shape.device)
            self.write_col = torch.zeros(1, dtype=torch.long, device=shape.device)
        else:
            self.valid, self.write_col = state
            if tuple(self.valid.shape) != (shape.batch_size, shape.capacity) or tuple(self.write_col.shape) != (1,):
                raise ValueError(f"state: valid {tuple(self.valid.shape)} / write_col {tuple(self.write_col.shape)} "
                                 f"do not match {shape.batch_size} slots x {shape.capacity} columns")
            self.valid.zero_()
        self.front = 0
        self.num_rows = self.read_start = self.read_end = 0
        self.stats = CacheStats()

    @property
    def num_slots(self) -> int:
        return self.shape.batch_size

    @property
    def capacity(self) -> int:
        return self.shape.capacity

    @property
    def column_bytes(self) -> int:
        """Bytes of one column of one row: keys + values over all layers."""
        num_layers, _, heads, _, dim = self.key_storage.shape
        return 2 * num_layers * heads * dim * self.key_storage.element_size()

    @property
    def nbytes(self) -> int:
        """Bytes the slots take: their columns at the storage's own width (padded or reused wider: the stride)."""
        return self.num_slots * (self.key_storage.stride(2) // self.key_storage.shape[4]) * self.column_bytes

    def reset(self, front: int) -> None:
        """Start a generation: no live rows, decode front at ``front``, counters zeroed."""
        self._check_front(front)
        self.front, self.num_rows = front, 0
        self.stats = CacheStats()

    def set_front(self, front: int) -> None:
        """Move the front while no row is live (nothing to copy)."""
        self._check_front(front)
        self.front = front

    # ---- decode -------------------------------------------------------------------------------
    def begin_decode(self, num_rows: int, max_extent: int) -> torch.Tensor:
        """Set the window for one decode forward of rows ``[0, num_rows)``; returns ``keep [n, 1, 1, w]``.

        Column ``front`` is written; ``[front - max_extent, front + 1)`` is read.
        """
        if self.front >= self.capacity:
            raise ValueError(f"capacity: decode front {self.front} reached the capacity {self.capacity}; "
                             "realign first")
        if not 0 < max_extent <= self.front:
            raise ValueError(f"max_extent: must be in [1, front={self.front}]; got {max_extent}")
        self.num_rows = num_rows
        self.read_start, self.read_end = self.front - max_extent, self.front + 1
        self.write_col.fill_(self.front)
        self.valid[:num_rows, self.front] = True
        return self.valid[:num_rows, None, None, self.read_start:self.read_end]

    def layer_window(self) -> tuple[int, torch.Tensor, int, int]:
        """What each layer's forward writes and reads (see ``OwnedKVLayer``)."""
        return self.num_rows, self.write_col, self.read_start, self.read_end

    def end_decode(self) -> None:
        self.front += 1

    # ---- refill, compaction, realign ----------------------------------------------------------
    def write_prompts(self, scratch: StaticKVCache, src: torch.Tensor, dst: torch.Tensor,
                      prompt_mask: torch.Tensor) -> None:
        """Copy scratch rows ``src`` (``[n]``, one per slot) into slots ``dst``, right-aligned at ``front``.

        The scratch holds a left-padded bucket ``[B_b, L_b]`` (``prompt_mask``) in its columns
        ``[0, L_b)``; the slots receive columns ``[front - L_b, front)`` and their whole ``valid`` row.
        """
        length = prompt_mask.shape[1]
        start = self.front - length
        if start < 0:
            raise ValueError(f"prompt_mask: bucket length {length} exceeds the front column {self.front}")
        for cache_buf, scratch_buf in ((self.key_storage, scratch.key_storage),
                                       (self.value_storage, scratch.value_storage)):
            rows = scratch_buf[:, :, :, :length].index_select(1, src)  # [L, n, H_kv, L_b, D]
            cache_buf[:, :, :, start:self.front].index_copy_(1, dst, rows)
        valid_rows = torch.zeros((dst.shape[0], self.capacity), dtype=torch.bool, device=self.valid.device)
        valid_rows[:, start:self.front] = prompt_mask.index_select(0, src).bool()
        self.valid.index_copy_(0, dst, valid_rows)
        self.stats.prefill_copy_bytes += dst.shape[0] * length * self.column_bytes

    def move_rows(self, src: torch.Tensor, dst: torch.Tensor, max_extent: int) -> None:
        """Compaction: copy row ``src[j]`` into row ``dst[j]`` (the scheduler's moves: sources and
        destinations disjoint) over the live window ``[front - max_extent, front)`` and whole ``valid`` rows."""
        start = self.front - max_extent
        for buf in (self.key_storage, self.value_storage):
            window = buf[:, :, :, start:self.front]
            window.index_copy_(1, dst, window.index_select(1, src))
        self.valid.index_copy_(0, dst, self.valid.index_select(0, src))
        self.stats.row_moves += src.shape[0]
        self.stats.bytes_moved += src.shape[0] * max_extent * self.column_bytes

    def realign(self, num_rows: int, max_extent: int, new_front: int) -> None:
        """Move the live block ``[front - max_extent, front)`` of rows ``[0, num_rows)`` so it ends at ``new_front``."""
        self._check_front(new_front)
        if new_front < max_extent:
            raise ValueError(f"new_front: {new_front} cannot hold the live extent {max_extent}")
        shift = new_front - self.front
        if shift == 0:
            return
        if num_rows:
            old, new = self.front - max_extent, new_front - max_extent
            for buf in (self.key_storage, self.value_storage):
                for layer in range(buf.shape[0]):  # one layer at a time bounds the temporary
                    block = buf[layer, :num_rows, :, old:self.front].clone()
                    buf[layer, :num_rows, :, new:new_front].copy_(block)
            rows = torch.zeros((num_rows, self.capacity), dtype=torch.bool, device=self.valid.device)
            rows[:, new:new_front] = self.valid[:num_rows, old:self.front]
            self.valid[:num_rows] = rows
            self.stats.bytes_moved += num_rows * max_extent * self.column_bytes
        if shift < 0:
            self.stats.trims += 1
        else:
            self.stats.shifts += 1
        self.front = new_front

    def _check_front(self, front: int) -> None:
        if not 0 <= front <= self.capacity:
            raise ValueError(f"capacity: front column {front} is outside [0, {self.capacity}]")

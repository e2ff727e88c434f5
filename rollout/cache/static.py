"""A static KV cache we own: preallocated per layer, fixed addresses, reused across calls.

``StaticKVCache`` subclasses transformers' ``Cache`` (duck-typing broke upstream DeepSpeed's cache on
transformers 5.17). Before every forward the runner sets the *write columns* (a device tensor of
column indices) and the *live length* (columns the attention reads); each layer writes the new keys
and values into its preallocated buffers in place and returns a view of the live prefix. Addresses
never change, so decode can later be captured in CUDA graphs.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from rollout.model import compat
from rollout.model.compat import Cache, CacheLayerMixin
from rollout.plan.buckets import storage_columns

#: Device types whose KV storage is padded to ``rollout.plan.buckets.storage_columns`` (where the stride was
#: measured to matter; tests add "cpu" to run the padded storage there).
PADDED_DEVICE_TYPES = ("cuda",)


class OwnedKVLayer(CacheLayerMixin):
    """One layer's keys and values in buffers we own (``[rows, H_kv, capacity, D]`` each, allocated once).

    Each forward writes its keys/values at the owner's write columns and returns the columns the
    owner says to read; ``owner.layer_window()`` gives ``(rows, write_cols, read_start, read_end)``.
    """

    is_compileable = True
    is_sliding = False

    def __init__(self, owner, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        # a weak reference: the owner holds its layers, so a strong one would make a reference cycle
        # and the storage would outlive a keep_cache=False call until the garbage collector ran
        # (seen on the H200: the whole 3B-shape KV cache, 576 MiB, still allocated after the call)
        self._owner = weakref.ref(owner)
        self.keys, self.values = keys, values
        self.device = keys.device
        self.is_initialized = True

    @property
    def owner(self):
        owner = self._owner()
        if owner is None:
            raise RuntimeError("this cache layer's cache is gone: keep the cache, not its layers")
        return owner

    def lazy_initialization(self, key_states, value_states) -> None:  # buffers exist from the start
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        rows, cols, start, end = self.owner.layer_window()
        keys, values = self.keys[:rows], self.values[:rows]
        keys.index_copy_(2, cols, key_states.to(keys.dtype))
        values.index_copy_(2, cols, value_states.to(values.dtype))
        return keys[:, :, start:end], values[:, :, start:end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        _, _, start, end = self.owner.layer_window()
        return end - start, 0

    def get_seq_length(self) -> int:
        _, _, start, end = self.owner.layer_window()
        return end - start

    def get_max_length(self) -> int:
        return self.keys.shape[2]


@dataclass(frozen=True)
class CacheShape:
    """What a cache must hold; a cache serves any request with smaller batch and capacity."""

    batch_size: int
    capacity: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    @property
    def column_bytes(self) -> int:
        """Bytes of one column of one row: keys + values over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def padded_head_bytes(self) -> int:
        """Bytes of one KV head's key column where the storage's width is padded (``PADDED_DEVICE_TYPES``), else 0:
        the second argument of ``rollout.plan.buckets.storage_columns``."""
        return self.head_dim * self.dtype.itemsize if torch.device(self.device).type in PADDED_DEVICE_TYPES else 0

    @property
    def storage_columns(self) -> int:
        """Columns a new storage for this shape allocates: ``capacity``, padded where the stride matters."""
        return storage_columns(self.capacity, self.padded_head_bytes)

    @property
    def storage_dims(self) -> tuple[int, int, int, int, int]:
        """``[layers, batch, KV heads, storage_columns, head dim]``: one new storage tensor's shape."""
        return self.num_layers, self.batch_size, self.num_kv_heads, self.storage_columns, self.head_dim

    def new_storage(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed keys and values of ``storage_dims`` (the two caches' own allocation when given none)."""
        return tuple(torch.zeros(self.storage_dims, dtype=self.dtype, device=self.device) for _ in range(2))

    def fits_in(self, other: "CacheShape") -> bool:
        return (self.batch_size <= other.batch_size and self.capacity <= other.capacity
                and (self.num_layers, self.num_kv_heads, self.head_dim, self.dtype, self.device)
                == (other.num_layers, other.num_kv_heads, other.head_dim, other.dtype, other.device))


def cache_shape(model, batch_size: int, capacity: int) -> CacheShape:
    """The cache shape for ``model``: its KV geometry, parameter dtype and device."""
    num_layers, num_kv_heads, head_dim = compat.kv_geometry(model)
    param = next(model.parameters())
    return CacheShape(batch_size, capacity, num_layers, num_kv_heads, head_dim, param.dtype, param.device)


class StaticKVCache(Cache):
    """Keys/values of every layer in two preallocated tensors ``[L, B, H_kv, columns, D]``: ``columns`` is the
    capacity, or more where a new storage is padded (``CacheShape.storage_columns``) or a larger one is reused."""

    def __init__(self, shape: CacheShape, storage: tuple[torch.Tensor, torch.Tensor] | None = None):
        if storage is None:
            storage = shape.new_storage()
        self.shape = shape
        self.key_storage, self.value_storage = storage
        b = shape.batch_size
        layers = [OwnedKVLayer(self, self.key_storage[i, :b], self.value_storage[i, :b])
                  for i in range(shape.num_layers)]
        super().__init__(layers=layers)
        self.write_cols = torch.zeros(1, dtype=torch.long, device=shape.device)
        self.live_len = 0

    def view(self, shape: CacheShape) -> "StaticKVCache":
        """A cache over the first ``shape.batch_size`` rows of this one's storage (no allocation)."""
        if not shape.fits_in(self.shape):
            raise ValueError(f"cache shape {shape} does not fit in {self.shape}")
        return StaticKVCache(shape, (self.key_storage, self.value_storage))

    def rows(self, start: int, stop: int) -> "StaticKVCache":
        """A cache over rows ``[start, stop)`` of this one's storage (no allocation): one prefill bucket."""
        shape = CacheShape(stop - start, self.shape.capacity, self.shape.num_layers, self.shape.num_kv_heads,
                           self.shape.head_dim, self.shape.dtype, self.shape.device)
        return StaticKVCache(shape, (self.key_storage[:, start:stop], self.value_storage[:, start:stop]))

    def layer_window(self) -> tuple[int, torch.Tensor, int, int]:
        return self.shape.batch_size, self.write_cols, 0, self.live_len

    def set_window(self, write_cols: torch.Tensor, live_len: int) -> None:
        """Columns the next forward writes (``[q]`` int64 on the cache device) and reads (``[0, live_len)``)."""
        self.write_cols = write_cols
        self.live_len = live_len

    @property
    def column_bytes(self) -> int:
        return self.shape.column_bytes

    @property
    def nbytes(self) -> int:
        return self.key_storage.nbytes + self.value_storage.nbytes

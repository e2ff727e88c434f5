"""Where the KV storage lives between calls: the engine's one ``CachePool`` (shared by both routes, so
a kept cache is never held twice) and the continuous route's ``ScratchArena`` for bucket prefills."""

from __future__ import annotations

import dataclasses

import torch

from rollout.cache.static import CacheShape, StaticKVCache


class CachePool:
    """Acquire/release policy: with ``keep`` the storage outlives a call and serves every later request
    that fits; without it the storage is dropped at release (no ``empty_cache``: the caching allocator
    reuses the blocks)."""

    def __init__(self, keep: bool):
        self.keep = keep
        self._cache: StaticKVCache | None = None
        self.num_allocations = 0

    def acquire(self, shape: CacheShape) -> StaticKVCache:
        if self._cache is not None and shape.fits_in(self._cache.shape):
            return self._cache.view(shape)
        self._cache = None  # drop the old storage before allocating the new one
        # recorded at the storage's own width, so a later call up to that width reuses it
        self._cache = StaticKVCache(dataclasses.replace(shape, capacity=shape.storage_columns))
        self.num_allocations += 1
        return self._cache.view(shape)

    def release(self) -> None:
        if not self.keep:
            self._cache = None

    def clear(self) -> None:
        self._cache = None

    @property
    def nbytes(self) -> int:
        return self._cache.nbytes if self._cache is not None else 0


class ScratchArena:
    """Flat key/value buffers for bucket prefills, grown to the largest bucket seen and reused.

    ``get(B, L)`` returns a ``StaticKVCache`` viewing the first ``L * B * H_kv * L * D`` elements as
    ``[num_layers, B, H_kv, L, D]``: one allocation serves buckets of any shape with ``B * L`` within it.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device):
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None
        self.num_allocations = 0

    @classmethod
    def like(cls, shape: CacheShape) -> "ScratchArena":
        return cls(shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.dtype, shape.device)

    def get(self, batch_size: int, length: int) -> StaticKVCache:
        numel = self.num_layers * batch_size * self.num_kv_heads * length * self.head_dim
        if self._keys is None or self._keys.numel() < numel:
            self._keys = self._values = None  # drop the old buffers before allocating the new ones
            self._keys = torch.zeros(numel, dtype=self.dtype, device=self.device)  # flat [L*B*H*T*D]
            self._values = torch.zeros(numel, dtype=self.dtype, device=self.device)
            self.num_allocations += 1
        dims = (self.num_layers, batch_size, self.num_kv_heads, length, self.head_dim)
        shape = CacheShape(batch_size, length, self.num_layers, self.num_kv_heads, self.head_dim,
                           self.dtype, self.device)
        return StaticKVCache(shape, (self._keys[:numel].view(dims), self._values[:numel].view(dims)))

    def release(self) -> None:
        self._keys = self._values = None

    @property
    def nbytes(self) -> int:
        return 0 if self._keys is None else 2 * self._keys.nbytes


def free_device_bytes(device: torch.device) -> int | None:
    """Memory a new allocation on ``device`` can use: free on the GPU plus what PyTorch's allocator holds
    unused (CUDA), or the host's available memory (CPU, Linux); None when it cannot be told."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as meminfo:
                for line in meminfo:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None

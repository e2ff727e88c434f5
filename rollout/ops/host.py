"""Host -> device copies that do not synchronize the host."""

from __future__ import annotations

import numpy as np
import torch


def to_device(values, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A host list/array as a device tensor without a host sync (pinned + non-blocking on CUDA)."""
    host = torch.from_numpy(np.ascontiguousarray(values)) if isinstance(values, np.ndarray) \
        else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class LaggedReads:
    """Device integers read on the host one read late, so that reading never drains the GPU's queue.

    ``post(value, tag)`` copies a 0-d device integer into pinned host memory without waiting and records
    an event after it; ``take()`` returns the oldest posted ``(value, tag)`` not yet taken, waiting on its
    event only. Posted before the next step is launched and taken after it, a value is read while that
    step keeps the GPU busy (the wait is a ``cudaEventSynchronize``, not a stream sync). On the CPU the
    copy is immediate and nothing waits. ``slots`` values may be outstanding at once."""

    def __init__(self, device: torch.device, slots: int = 2):
        self._cuda = device.type == "cuda"
        self._values = torch.zeros(slots, dtype=torch.long, pin_memory=self._cuda)
        self._events = [torch.cuda.Event() for _ in range(slots)] if self._cuda else []
        self._pending: list[tuple[int, object]] = []  # (slot, tag), oldest first
        self._next = 0

    def post(self, value: torch.Tensor, tag=None) -> None:
        if len(self._pending) == self._values.shape[0]:
            raise RuntimeError(f"LaggedReads: {len(self._pending)} values posted and none taken (take first)")
        slot, self._next = self._next, (self._next + 1) % self._values.shape[0]
        self._values[slot].copy_(value, non_blocking=self._cuda)
        if self._cuda:
            self._events[slot].record()
        self._pending.append((slot, tag))

    def take(self) -> tuple[int, object]:
        slot, tag = self._pending.pop(0)
        if self._cuda:
            self._events[slot].synchronize()
        return int(self._values[slot]), tag

    def __len__(self) -> int:
        """Values posted and not yet taken."""
        return len(self._pending)

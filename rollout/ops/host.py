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

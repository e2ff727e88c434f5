"""RMSNorm as the step computes it (HF's Llama/Qwen2 arithmetic): the one definition that the compiled pieces
(:mod:`rollout.model.step`) and the fused kernels' PyTorch path (:mod:`rollout.ops.skinny_linear`) share."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in fp32, round to ``x``'s dtype, then scale by ``weight`` (in that dtype)."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)

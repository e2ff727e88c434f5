"""Prefill and decode forwards through the model's own (HF) layers over a cache we own.

These serve every model the fused step does not (``rollout.model.weights.unsupported_reason``), unfused
LoRA and ZeRO-3 per-forward gathering. The cache is any of ours (``rollout.cache``): it is told which
columns the forward writes and which it reads, and hands each layer views of its own buffers.
"""

from __future__ import annotations

import torch

from rollout.model import compat
from rollout.ops import masks


def prefill_forward(model, cache, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, prompt_len: int,
                    mask_dtype: torch.dtype) -> torch.Tensor:
    """One HF forward writing ``prompt_ids [b, L]`` into prompt columns ``[T_p - L, T_p)`` of ``cache``'s
    rows; returns the last position's logits ``[b, V]``. Earlier columns of these rows must be padding.
    (Our own prefill is :func:`rollout.model.prefill.prefill_logits`.)"""
    length = prompt_ids.shape[1]
    start = prompt_len - length
    cache.set_window(torch.arange(start, start + length, device=prompt_ids.device), start + length)
    keep = masks.prefill_mask(prompt_mask)
    if start:  # the padding columns [0, start) are never attended: zero them so stale values cannot leak
        cache.key_storage[:, :, :, :start].zero_()
        cache.value_storage[:, :, :, :start].zero_()
        keep = torch.cat([keep.new_zeros(keep.shape[:3] + (start,)), keep], dim=-1)
    mask = compat.to_model_mask(keep, model, mask_dtype)
    return compat.forward_last_logits(model, prompt_ids, masks.prompt_positions(prompt_mask), mask, cache)


def decode_forward(model, cache, tokens: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor,
                   mask_dtype: torch.dtype) -> torch.Tensor:
    """One HF forward of one token per row (``tokens [N]`` at ``positions [N]``) over the columns ``cache``
    was told to read; ``keep [N, 1, 1, L]`` bool says which of them each row attends. Logits ``[N, V]``."""
    mask = compat.to_model_mask(keep, model, mask_dtype)
    return compat.forward_last_logits(model, tokens[:, None], positions[:, None], mask, cache)

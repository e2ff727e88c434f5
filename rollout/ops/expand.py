"""Prompt expansion: ``n_samples_per_prompt`` copies of each prompt, adjacent (row i <- prompt i // n)."""

from __future__ import annotations

import torch


def expand_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, num_samples: int):
    """``(ids [B*n, T_p], mask [B*n, T_p])``; returns the inputs themselves when ``num_samples == 1``."""
    if num_samples == 1:
        return prompt_ids, prompt_mask
    return (prompt_ids.repeat_interleave(num_samples, dim=0),
            prompt_mask.repeat_interleave(num_samples, dim=0))

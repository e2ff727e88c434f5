"""The checks of a call's inputs and the prompt layout, in one host sync."""

from __future__ import annotations

from typing import Optional

import torch

from rollout.ops.masks import layout_tensors
from rollout.plan.layout import PromptLayout, layout_from_lists


def checked_layout(ids: torch.Tensor, mask: torch.Tensor, vocab_size: int, max_new_tokens: int,
                   context_limit: Optional[int],
                   context_source: str = "the model's max_position_embeddings") -> PromptLayout:
    """Value checks of ``ids``/``mask`` ``[B, T_p]`` (on the model's device) and their layout, read in one
    host sync: [mask entries other than 0 and 1, id min, id max] + real tokens per row + first real column
    per row. Raises ``ValueError`` naming the field for anything the rollout cannot run exactly;
    ``context_source`` names where ``context_limit`` was read."""
    num_rows, prompt_len = ids.shape
    not_binary = ((mask != 0) & (mask != 1)).sum()
    values = torch.cat([torch.stack([not_binary, ids.min().long(), ids.max().long()]).long(),
                        layout_tensors(mask).flatten()]).tolist()
    (bad_mask, low, high), counts, firsts = values[:3], values[3:3 + num_rows], values[3 + num_rows:]
    if bad_mask:
        raise ValueError(f"prompt_attention_mask: values must be exactly 0 or 1; {bad_mask} entries are not")
    if min(counts) < 1:
        raise ValueError("prompt_attention_mask: every row needs at least one prompt token (a row is all 0)")
    if low < 0 or high >= vocab_size:
        raise ValueError(f"prompt_ids: token ids must be in [0, {vocab_size}); got [{low}, {high}]")
    total = prompt_len + max_new_tokens
    if context_limit is not None and total > context_limit:
        raise ValueError(f"max_new_tokens: prompt length {prompt_len} + max_new_tokens {max_new_tokens} = {total} "
                         f"exceeds the context limit {context_limit} ({context_source})")
    return layout_from_lists(counts, firsts, prompt_len)

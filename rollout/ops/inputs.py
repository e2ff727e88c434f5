"""The checks of a call's inputs and the prompt layout, in one host sync."""

from __future__ import annotations

from typing import Optional

import torch

from rollout.ops.masks import layout_tensors
from rollout.plan.layout import PromptLayout, layout_from_lists


def checked_layout(ids: torch.Tensor, mask: torch.Tensor, vocab_size: int, max_new_tokens: int,
                   context_limit: Optional[int]) -> PromptLayout:
    """Value checks of ``ids``/``mask`` ``[B, T_p]`` (on the model's device) and their layout, read in one
    host sync: [mask min, mask max, id min, id max] + real tokens per row + first real column per row.
    Raises ``ValueError`` naming the field for anything the rollout cannot run exactly."""
    num_rows, prompt_len = ids.shape
    checks = torch.cat([torch.stack([mask.min(), mask.max(), ids.min(), ids.max()]).long(),
                        layout_tensors(mask).flatten()]).tolist()
    if checks[0] < 0 or checks[1] > 1:
        raise ValueError("prompt_attention_mask: values must be 0 or 1")
    counts, firsts = checks[4:4 + num_rows], checks[4 + num_rows:]
    if min(counts) < 1:
        raise ValueError("prompt_attention_mask: every row needs at least one prompt token (a row is all 0)")
    if checks[2] < 0 or checks[3] >= vocab_size:
        raise ValueError(f"prompt_ids: token ids must be in [0, {vocab_size}); got [{checks[2]}, {checks[3]}]")
    total = prompt_len + max_new_tokens
    if context_limit is not None and total > context_limit:
        raise ValueError(f"max_new_tokens: prompt length {prompt_len} + max_new_tokens {max_new_tokens} = {total} "
                         f"exceeds the model context {context_limit}")
    return layout_from_lists(counts, firsts, prompt_len)

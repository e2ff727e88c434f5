"""Pure builders of positions and attention masks for a left-padded batch over a static cache.

Physical layout of the cache (one row per sample): columns ``[0, T_p)`` hold the padded prompt,
column ``T_p + k`` holds generated token ``k``. Every row's decode front is the same column, so one
scalar column index serves the whole batch. Masks here are boolean, True = may attend;
:mod:`rollout.compat` converts them to what the model's attention implementation expects.
"""

from __future__ import annotations

import torch


def prompt_positions(prompt_mask: torch.Tensor) -> torch.Tensor:
    """``position_ids [B, T_p]`` as HF ``generate`` makes them: cumulative count of real tokens - 1,
    and 1 on padding (its value never matters: padding is masked out)."""
    positions = prompt_mask.long().cumsum(-1) - 1
    return positions.masked_fill_(prompt_mask == 0, 1)


def key_validity(prompt_mask: torch.Tensor, capacity: int) -> torch.Tensor:
    """``valid [B, capacity]`` bool: the prompt mask, then True for every generated column."""
    batch, prompt_len = prompt_mask.shape
    valid = torch.ones((batch, capacity), dtype=torch.bool, device=prompt_mask.device)
    valid[:, :prompt_len] = prompt_mask.bool()
    return valid


def prefill_mask(prompt_mask: torch.Tensor) -> torch.Tensor:
    """``keep [B, 1, T_p, T_p]`` bool: causal, keys restricted to real tokens.

    A padding query would have no key at all (a fully masked softmax row gives NaN, and NaN in a
    padding row's values poisons later layers through ``0 * NaN``), so every query also sees itself.
    That changes nothing for real tokens: their own column is already allowed.
    """
    prompt_len = prompt_mask.shape[1]
    cols = torch.arange(prompt_len, device=prompt_mask.device)
    causal = cols[None, :] <= cols[:, None]  # [T_p, T_p]
    keep = causal[None] & prompt_mask.bool()[:, None, :]  # [B, T_p, T_p]
    keep |= torch.eye(prompt_len, dtype=torch.bool, device=prompt_mask.device)
    return keep[:, None]


def decode_mask(valid: torch.Tensor, live_len: int) -> torch.Tensor:
    """``keep [B, 1, 1, live_len]`` for the single query at column ``live_len - 1``."""
    return valid[:, None, None, :live_len]


def layout_tensors(prompt_mask: torch.Tensor) -> torch.Tensor:
    """``[2, B]`` int64 on the device: each row's real-token count and its first real column (no sync;
    :func:`rollout.plan.layout.layout_from_lists` takes their host copies, in this order)."""
    real = prompt_mask != 0
    return torch.stack([real.sum(dim=1), real.int().argmax(dim=1)]).long()

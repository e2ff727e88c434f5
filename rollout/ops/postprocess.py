"""Post-processing: generated tokens -> ``RolloutBatch`` (see :mod:`rollout.request` for semantics).

``postprocess_reference`` mirrors the per-row Python loop of the upstream implementation (the seed
feature request's candidate for optimisation) and serves as the test oracle; ``postprocess`` is the
batched version used in production: a fixed number of tensor ops and one host sync (the output
width), whatever the batch size.
"""

from __future__ import annotations

from typing import Optional

import torch

from rollout.request import FINISH_BUDGET, FINISH_EOS, RolloutBatch


def eos_tensor(eos_token_ids: tuple[int, ...], device: torch.device) -> torch.Tensor | None:
    return torch.tensor(eos_token_ids, dtype=torch.long, device=device) if eos_token_ids else None


def response_lengths(generated: torch.Tensor, eos_ids: torch.Tensor | None,
                     budgets: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``lengths [N]``: position of the first EOS + 1 (the EOS is kept), or the full width; at most the row's
    own budget (``budgets [N]``, ``RolloutRequest.row_max_new_tokens``) where given."""
    num_rows, width = generated.shape
    if eos_ids is None or width == 0:
        lengths = torch.full((num_rows,), width, dtype=torch.long, device=generated.device)
    else:
        is_eos = torch.isin(generated, eos_ids)  # [N, S]
        first = is_eos.int().argmax(dim=1)
        lengths = torch.where(is_eos.any(dim=1), first + 1, width)
    return lengths if budgets is None else torch.minimum(lengths, budgets.to(lengths.device, torch.long))


def response_mask(generated: torch.Tensor, eos_token_ids: tuple[int, ...],
                  budgets: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``mask [N, T_r]`` bool from positions: True up to and including each row's first EOS, ``T_r``
    the longest response. One host sync (the output width)."""
    lengths = response_lengths(generated, eos_tensor(eos_token_ids, generated.device), budgets)
    width = int(lengths.max()) if lengths.numel() else 0  # the one host sync
    cols = torch.arange(width, device=generated.device)
    return cols[None, :] < lengths[:, None]  # [N, T_r]


def assemble(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, generated: torch.Tensor,
             mask: torch.Tensor, pad_token_id: int, extras: Optional[dict] = None) -> RolloutBatch:
    """``[prompt | response]`` with the response padded where ``mask`` (from :func:`response_mask`) is 0.
    ``extras``: the optional ``RolloutBatch`` fields (``finish_reasons``, ``logprobs``)."""
    response = torch.where(mask, generated[:, :mask.shape[1]], pad_token_id)
    input_ids = torch.cat([prompt_ids, response.to(prompt_ids.dtype)], dim=1)
    attention_mask = torch.cat([prompt_mask.long(), mask.long()], dim=1)
    start = torch.full((prompt_ids.shape[0],), prompt_ids.shape[1], dtype=torch.long, device=prompt_ids.device)
    return RolloutBatch(input_ids=input_ids, attention_mask=attention_mask, response_start_idx=start,
                        **(extras or {}))


def finish_reasons(generated: torch.Tensor, eos_token_ids: tuple[int, ...],
                   budgets: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[N]`` int8: ``FINISH_EOS`` where the row holds an EOS token (within its own budget, ``budgets [N]``,
    where given), else ``FINISH_BUDGET`` (a row without EOS ran to its budget: every route stops early only
    when all rows have ended)."""
    eos = eos_tensor(eos_token_ids, generated.device)
    if eos is None:
        return torch.full((generated.shape[0],), FINISH_BUDGET, dtype=torch.int8, device=generated.device)
    is_eos = torch.isin(generated, eos)
    if budgets is not None:
        cols = torch.arange(generated.shape[1], device=generated.device)
        is_eos &= cols[None, :] < budgets.to(generated.device, torch.long)[:, None]
    return is_eos.any(dim=1).to(torch.int8) * (FINISH_EOS - FINISH_BUDGET) + FINISH_BUDGET


def masked_logprobs(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[N, T_r]`` float32 response log-probs, 0 where the response mask is 0."""
    return torch.where(mask, logprobs[:, :mask.shape[1]].float(), 0.0)


def postprocess(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, generated: torch.Tensor,
                eos_token_ids: tuple[int, ...], pad_token_id: int) -> RolloutBatch:
    """Batched post-processing: :func:`response_mask` then :func:`assemble`.

    ``prompt_ids``/``prompt_mask`` are the expanded prompts ``[N, T_p]``; ``generated [N, S]`` the
    raw tokens of every decode step (whatever came after a row's EOS is discarded here).
    """
    return assemble(prompt_ids, prompt_mask, generated, response_mask(generated, eos_token_ids), pad_token_id)


def postprocess_reference(request_prompt_ids: torch.Tensor, request_prompt_mask: torch.Tensor,
                          generated: torch.Tensor, num_samples: int, eos_token_ids: tuple[int, ...],
                          pad_token_id: int) -> RolloutBatch:
    """Reference: one Python iteration per output row, reading the *unexpanded* request.

    Row ``i`` takes prompt ``i // num_samples``; its response runs to the first EOS (kept) or the
    end; the output width is the longest response.
    """
    num_rows, width = generated.shape
    prompt_len = request_prompt_ids.shape[1]
    eos = set(eos_token_ids)
    rows, lengths = [], []
    for i in range(num_rows):
        tokens = generated[i].tolist()
        length = width
        for k, token in enumerate(tokens):
            if token in eos:
                length = k + 1
                break
        rows.append(tokens[:length])
        lengths.append(length)
    out_width = max(lengths) if lengths else 0
    input_ids = torch.full((num_rows, prompt_len + out_width), pad_token_id, dtype=request_prompt_ids.dtype)
    attention_mask = torch.zeros((num_rows, prompt_len + out_width), dtype=torch.long)
    for i in range(num_rows):
        source = i // num_samples
        input_ids[i, :prompt_len] = request_prompt_ids[source].cpu()
        attention_mask[i, :prompt_len] = request_prompt_mask[source].cpu().long()
        input_ids[i, prompt_len:prompt_len + lengths[i]] = torch.tensor(rows[i], dtype=input_ids.dtype)
        attention_mask[i, prompt_len:prompt_len + lengths[i]] = 1
    device = generated.device
    return RolloutBatch(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                        response_start_idx=torch.full((num_rows,), prompt_len, dtype=torch.long, device=device))

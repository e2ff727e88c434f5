"""The inputs of the OPSD step's forwards: student and teacher token columns, the loss mask, row figures.

Alignment. The logits at position ``t`` predict token ``t + 1``. Only the last ``k = T - s + 1``
positions are computed (``logits_to_keep=k``, ``s`` the first response column): position ``s - 1``
predicts the first response token; the last kept position predicts nothing and is masked out. The
loss mask is :func:`rollout.opsd.losses.response_logit_positions` restricted to those ``k`` columns;
a micro-batch whose responses end earlier keeps fewer (its first ``k'`` columns). Position ids count
real tokens (``cumsum(mask) - 1``), as in the rollout's own forwards, so dropping all-padding
columns at either end of a micro-batch changes no logit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from rollout.checks import require
from rollout.ops import masks
from rollout.opsd.losses import response_logit_positions
from rollout.opsd.micro_batches import RowStats
from rollout.request import RolloutBatch


@dataclass(frozen=True)
class DistillInputs:
    """Everything the micro-batches index into (device tensors) plus the host figures."""

    ids: torch.Tensor
    """``[N, T]`` student input ids (prompt + response)."""
    mask: torch.Tensor
    """``[N, T]`` student attention mask."""
    teacher_ids: torch.Tensor
    """``[N, T_t + T_r]`` teacher input ids (the student's, or a teacher prompt + the response)."""
    teacher_mask: torch.Tensor
    """``[N, T_t + T_r]`` teacher attention mask."""
    loss_mask: torch.Tensor
    """``[N, k]`` bool over the last ``k`` logits: column ``j`` predicts response column ``j``."""
    stats: RowStats
    """Per-row figures (host)."""
    num_positions: int
    """Loss positions of the whole batch."""
    max_token_id: int
    """Largest id in ``ids``."""
    min_token_id: int = 0
    """Smallest id in ``ids`` and the teacher's ids (checked on every rank by ``ranks.check_figures``)."""


def _teacher_columns(batch: RolloutBatch, start_col: int, teacher_prompts):
    """``(ids, mask, response column)`` of the teacher's input."""
    if teacher_prompts is None:
        return batch.input_ids, batch.attention_mask, start_col
    require(start_col == int(batch.response_start_idx.max()), "response_start_idx",
             "must be equal in every row to replace the teacher's prompt")
    prompt_ids, prompt_mask = teacher_prompts
    ids = torch.cat([prompt_ids.to(batch.input_ids.device), batch.input_ids[:, start_col:]], dim=1)
    mask = torch.cat([prompt_mask.to(batch.attention_mask.device), batch.attention_mask[:, start_col:]], dim=1)
    return ids, mask, prompt_ids.shape[1]  # ids, mask: [N, T_t + T_r]


def _first_real_column(mask: torch.Tensor) -> torch.Tensor:
    """``[N]``: index of each row's first real token (0 for a row without any)."""
    return torch.argmax((mask != 0).to(torch.int8), dim=1)  # argmax returns the first maximum


def distill_inputs(batch: RolloutBatch, teacher_prompts: Optional[tuple]) -> DistillInputs:
    """The step's inputs (one host sync for every figure)."""
    require(batch.batch_size > 0, "batch", "has no rows (nothing to distil on)")
    seq_len, start_col = batch.seq_len, int(batch.response_start_idx.min())
    full = response_logit_positions(batch.attention_mask, batch.response_start_idx, full_length=True)
    num_kept = seq_len - start_col + 1
    loss_mask = full[:, seq_len - num_kept:]  # [N, k]; column j predicts token start_col + j
    teacher_ids, teacher_mask, teacher_col = _teacher_columns(batch, start_col, teacher_prompts)
    real = batch.attention_mask[:, start_col:] != 0  # real: [N, T_r]
    columns = torch.arange(1, real.shape[1] + 1, device=real.device)
    extent = torch.where(real, columns, 0).amax(dim=1) if real.shape[1] else real.sum(dim=1)  # [N]
    per_row = torch.stack([loss_mask.sum(dim=1), extent, _first_real_column(batch.attention_mask),
                           _first_real_column(teacher_mask), (batch.attention_mask != 0).sum(dim=1)])  # [5, N]
    lowest = torch.minimum(batch.input_ids.min(), teacher_ids.min()).view(1)
    masks = (batch.attention_mask,) + ((teacher_mask[:, :teacher_col],) if teacher_prompts is not None else ())
    soft = sum(((m != 0) & (m != 1)).sum() for m in masks).view(1)  # entries neither 0 nor 1
    host = torch.cat([per_row.flatten(), batch.input_ids.max().view(1).to(per_row.dtype), soft.to(per_row.dtype),
                      lowest.to(per_row.dtype)]).tolist()  # one sync
    lowest = int(host.pop())  # refused by ranks.check_figures on every rank, not here on one (the others would wait)
    soft = int(host.pop())  # a ValueError here is raised by the step after its collectives (OPSDStep._distill)
    require(soft == 0, "attention_mask", f"must hold 0 and 1 only (a token mask, not weights); {soft} entries of the "
            "batch's (or its teacher prompts') masks are neither")
    rows = batch.batch_size
    counts, extents, firsts, teacher_firsts, tokens = (tuple(host[i * rows:(i + 1) * rows]) for i in range(5))
    stats = RowStats(counts, extents, firsts, teacher_firsts, start_col, teacher_col, tokens)
    return DistillInputs(batch.input_ids, batch.attention_mask, teacher_ids, teacher_mask, loss_mask, stats,
                         sum(counts), int(host[-1]), lowest)


def forward_logits(model, keeps: bool, ids: torch.Tensor, mask: torch.Tensor, num_kept: int) -> torch.Tensor:
    """Logits ``[n, k, V]`` of the last ``k`` positions (``logits_to_keep`` where supported)."""
    positions = masks.prompt_positions(mask)  # [n, T]: real-token count - 1, as in the rollout
    extra = {"logits_to_keep": num_kept} if keeps else {}
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False, **extra).logits
    return logits if logits.shape[1] == num_kept else logits[:, -num_kept:]

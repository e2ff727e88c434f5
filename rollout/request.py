"""Input and output records of ``Rollout.generate`` (DeepSpeed's field names, so users can switch).

Semantics
---------
Prompts are left-padded ``[B, T_p]``. Output row ``i`` belongs to prompt ``i // n``
(``n = n_samples_per_prompt``). ``input_ids = [prompt | response]``, right-padded to the longest
response; ``response_start_idx[i] == T_p``. The response mask comes from positions, never from token
values: a generated token equal to the pad id keeps mask 1; the first EOS is kept (mask 1) even when
pad == eos; everything after it is pad with mask 0. The prompt part of the mask equals the expanded
prompt mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

#: ``RolloutBatch.finish_reasons`` codes.
FINISH_BUDGET, FINISH_EOS = 0, 1
FINISH_NAMES = {FINISH_BUDGET: "budget", FINISH_EOS: "eos"}
#: Dtypes an embedding lookup takes.
TOKEN_DTYPES = (torch.int64, torch.int32)


@dataclass
class RolloutRequest:
    """Prompts for one ``generate`` call."""

    prompt_ids: torch.Tensor
    """``[B, T_p]`` token ids, left-padded."""
    prompt_attention_mask: torch.Tensor
    """``[B, T_p]``, 1 on real prompt tokens, 0 on padding. Every row needs at least one 1."""
    row_max_new_tokens: Optional[torch.Tensor] = None
    """``[B*n]`` integers, each output row's own token budget in ``1..SamplingConfig.max_new_tokens`` (row ``i``
    is sample ``i % n`` of prompt ``i // n``): a row stops there as at the budget (finish reason ``budget``
    unless an EOS came first) and stops costing decode steps. None: every row's budget is ``max_new_tokens``.
    For workloads whose response lengths are set in advance (length-controlled training, benchmarks that
    replay a length distribution)."""

    def __post_init__(self) -> None:
        ids, mask = self.prompt_ids, self.prompt_attention_mask
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            raise ValueError(f"prompt_ids: must be a 2-D tensor [B, T_p]; got {_shape(ids)}")
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
            raise ValueError(f"prompt_attention_mask: must be a 2-D tensor [B, T_p]; got {_shape(mask)}")
        if mask.shape != ids.shape:
            raise ValueError(f"prompt_attention_mask: shape {tuple(mask.shape)} does not match prompt_ids "
                             f"{tuple(ids.shape)}")
        if ids.shape[0] == 0 or ids.shape[1] == 0:
            raise ValueError(f"prompt_ids: needs at least one row and one column; got {tuple(ids.shape)}")
        if ids.dtype not in TOKEN_DTYPES:
            raise ValueError(f"prompt_ids: must hold token ids as int64 or int32; got dtype {ids.dtype}")
        if mask.dtype.is_complex:
            raise ValueError(f"prompt_attention_mask: must be bool, integer or floating 0/1; got dtype {mask.dtype}")
        for name, tensor in (("prompt_ids", ids), ("prompt_attention_mask", mask)):
            if tensor.device.type == "meta":
                raise ValueError(f"{name}: is on the meta device (no data); pass a tensor with values")
        budgets = self.row_max_new_tokens
        if budgets is not None and (not isinstance(budgets, torch.Tensor) or budgets.dim() != 1
                                    or budgets.dtype.is_floating_point or budgets.dtype.is_complex
                                    or budgets.dtype == torch.bool or budgets.device.type == "meta"):
            raise ValueError(f"row_max_new_tokens: must be None or a 1-D integer tensor [B*n] with values; got "
                             f"{_shape(budgets)}{'' if not isinstance(budgets, torch.Tensor) else f' {budgets.dtype}'}")

    def row_budgets(self, num_samples: int, max_new_tokens: int) -> Optional[tuple[int, ...]]:
        """``row_max_new_tokens`` on the host, checked against the call's ``n`` and budget (one host read)."""
        if self.row_max_new_tokens is None:
            return None
        rows = self.batch_size * num_samples
        if self.row_max_new_tokens.shape[0] != rows:
            raise ValueError(f"row_max_new_tokens: needs one budget per output row (B*n = {self.batch_size}*"
                             f"{num_samples} = {rows}); got {self.row_max_new_tokens.shape[0]}")
        values = tuple(self.row_max_new_tokens.tolist())
        bad = [v for v in values if not 1 <= v <= max_new_tokens]
        if bad:
            raise ValueError(f"row_max_new_tokens: every budget must be in [1, max_new_tokens={max_new_tokens}]; "
                             f"got {bad[0]} ({len(bad)} outside)")
        return values

    @property
    def batch_size(self) -> int:
        return int(self.prompt_ids.shape[0])

    @property
    def prompt_len(self) -> int:
        return int(self.prompt_ids.shape[1])


@dataclass
class RolloutBatch:
    """Prompt + response of every sample, in one right-padded tensor."""

    input_ids: torch.Tensor
    """``[B*n, T_p + T_r]``: ``[prompt | response]``."""
    attention_mask: torch.Tensor
    """``[B*n, T_p + T_r]``: expanded prompt mask, then 1 up to and including the first EOS."""
    response_start_idx: torch.Tensor
    """``[B*n]`` int64, all equal to ``T_p``."""
    finish_reasons: Optional[torch.Tensor] = None
    """``[B*n]`` int8, with ``SamplingConfig(return_finish_reasons=True)``: ``FINISH_EOS`` (the row ended
    with an EOS token) or ``FINISH_BUDGET`` (it reached its budget: ``max_new_tokens``, or its own
    ``RolloutRequest.row_max_new_tokens``); None otherwise."""
    logprobs: Optional[torch.Tensor] = None
    """``[B*n, T_r]`` float32, with ``SamplingConfig(return_logprobs=True)``: each response token's
    log-probability under the distribution it was drawn from (0 where the response mask is 0)."""

    def __post_init__(self) -> None:
        _check_batch_tensors(self)
        if self.input_ids.dim() != 2:
            raise ValueError(f"input_ids: must be 2-D; got {tuple(self.input_ids.shape)}")
        if self.attention_mask.shape != self.input_ids.shape:
            raise ValueError(f"attention_mask: shape {tuple(self.attention_mask.shape)} does not match "
                             f"input_ids {tuple(self.input_ids.shape)}")
        if self.response_start_idx.shape != (self.input_ids.shape[0],):
            raise ValueError(f"response_start_idx: must be 1-D of length {self.input_ids.shape[0]}; got "
                             f"{tuple(self.response_start_idx.shape)}")

        rows = self.input_ids.shape[0]
        if self.finish_reasons is not None and self.finish_reasons.shape != (rows,):
            raise ValueError(f"finish_reasons: must be 1-D of length {rows}; got {tuple(self.finish_reasons.shape)}")
        width = self.input_ids.shape[1] - (int(self.response_start_idx[0]) if rows else 0)
        if self.logprobs is not None and tuple(self.logprobs.shape) != (rows, width):
            raise ValueError(f"logprobs: must be [{rows}, {width}] (rows x response columns); got "
                             f"{tuple(self.logprobs.shape)}")

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    def finish_reason_names(self) -> list[str]:
        """``"eos"`` / ``"budget"`` per row (requires ``return_finish_reasons``)."""
        if self.finish_reasons is None:
            raise ValueError("finish_reasons: not requested (SamplingConfig(return_finish_reasons=True))")
        return [FINISH_NAMES[int(code)] for code in self.finish_reasons.tolist()]


def _check_batch_tensors(batch: RolloutBatch) -> None:
    """Types, dtypes and devices of a batch (metadata only, no sync): a batch built by hand for
    ``OPSDStep.train_on_batch`` with float ids, a list or a tensor on another device failed deep in a forward."""
    for name in ("input_ids", "attention_mask", "response_start_idx", "finish_reasons", "logprobs"):
        value = getattr(batch, name)
        if value is None and name in ("finish_reasons", "logprobs"):
            continue
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{name}: must be a torch.Tensor; got {type(value).__name__}")
        if value.device.type == "meta":
            raise ValueError(f"{name}: is on the meta device (no data); pass a tensor with values")
    if batch.input_ids.dtype not in TOKEN_DTYPES:
        raise ValueError(f"input_ids: must hold token ids as int64 or int32; got dtype {batch.input_ids.dtype}")
    if batch.response_start_idx.dtype.is_floating_point or batch.response_start_idx.dtype == torch.bool:
        raise ValueError(f"response_start_idx: must be an integer tensor; got dtype {batch.response_start_idx.dtype}")
    for name in ("attention_mask", "response_start_idx"):
        device = getattr(batch, name).device
        if device != batch.input_ids.device:
            raise ValueError(f"{name}: is on {device}, input_ids on {batch.input_ids.device}; put them on one device")


def _shape(value) -> str:
    return str(tuple(value.shape)) if isinstance(value, torch.Tensor) else type(value).__name__

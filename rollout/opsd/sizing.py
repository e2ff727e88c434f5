"""How many rows fit in one micro-batch: the memory estimate behind ``max_student_rows="auto"``.

Estimate (bytes), for a decoder of ``L`` layers, hidden size ``H``, MLP size ``I``, parameters of
``b`` bytes (e.g. 2 for bf16):

* per input token, the student's activations kept for backward:
  ``L * (b / 2) * (ACTIVATION_H * H + ACTIVATION_I * I) + 8 * H``. The coefficients were measured
  with ``torch.autograd.graph.saved_tensors_hooks`` on Qwen2-shaped bf16 models (RMSNorm keeps a
  float32 copy of its input; q/k/v, RoPE, attention output; SiLU, gate * up, down_proj input);
  ``8 * H`` covers the embeddings and the final norm. With gradient checkpointing on, only each
  layer's input (``L * b * H``) plus one layer's activations are kept;
* per input token, the teacher's transient activations of one layer (no grad): ``(2 I + 4 H) * b_t``;
* per kept logits position: the student's logits and the gradient buffer of the loss
  (``2 * V_s * b``), the teacher's logits (``V_t * b_t``) and the cache (``V * b_cache``, or
  ``K * (b_cache + 4)`` for top-k);
* per micro-batch: the float32 scratch of one loss chunk and one cache chunk
  (``10 * c * V_s * 4``, ``c`` the chunk size or the micro-batch's positions if fewer).

The budget: ``OPSDConfig.max_micro_batch_gib``, or by default :data:`AUTO_FREE_FRACTION` of the
device memory free when the distillation starts (the driver's free memory plus what PyTorch's
allocator holds unused; :data:`PACKED_FREE_FRACTION` on the packed path), :data:`CPU_MICRO_BATCH_GIB` on the CPU.
"""

from __future__ import annotations

from typing import Optional

import torch

from rollout.opsd.logit_cache import LogitCacheConfig
from rollout.opsd.micro_batches import RowCost

#: Activation bytes per token and layer, per unit of hidden size and of MLP size, at 2-byte params.
ACTIVATION_H, ACTIVATION_I = 22, 8
#: Share of the free device memory one micro-batch may use by default (the rest: fragmentation,
#: gradients and optimizer state allocated on the first step, collectives' buffers).
AUTO_FREE_FRACTION = 0.6
#: The same share on the packed path, whose estimate has no logits term: 0.45 keeps the 3B RL step's peak near 100
#: GiB (at 0.6 it peaked at 110 GiB with 9k-token micro-batches, at 37 GiB of budget 117 GiB with 7.1k, in the same
#: time: docs/BENCHMARKS.md, table 8).
PACKED_FREE_FRACTION = 0.45
#: Default micro-batch budget on the CPU (GiB).
CPU_MICRO_BATCH_GIB = 8.0
GIB = float(1 << 30)


def _dims(config) -> tuple[int, int, int]:
    hidden = int(config.hidden_size)
    return int(config.num_hidden_layers), hidden, int(getattr(config, "intermediate_size", None) or 4 * hidden)


def _param_bytes(model: torch.nn.Module) -> int:
    param = next(iter(model.parameters()), None)
    return 4 if param is None else param.element_size()


def _cache_bytes_per_position(cache: LogitCacheConfig, vocab: int) -> int:
    item = torch.empty((), dtype=cache.dtype).element_size()
    return vocab * item if cache.top_k is None else cache.top_k * (item + 4)


def is_checkpointing(model: torch.nn.Module) -> bool:
    """Whether HF gradient (activation) checkpointing is on (the newer name first: the older warns)."""
    name = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") \
        else "is_gradient_checkpointing"
    return bool(getattr(model, name, False))


def row_cost(student: torch.nn.Module, teacher: torch.nn.Module, cache: LogitCacheConfig,
             loss_chunk_size: int) -> RowCost:
    """The estimate of the module docstring for this student (HF causal LM) and teacher."""
    layers, hidden, mlp = _dims(student.config)
    width = _param_bytes(student)
    per_layer = width / 2 * (ACTIVATION_H * hidden + ACTIVATION_I * mlp)
    if is_checkpointing(student):
        kept = layers * width * hidden + per_layer
    else:
        kept = layers * per_layer
    _, t_hidden, t_mlp = _dims(teacher.config)
    t_width = _param_bytes(teacher)
    s_vocab, t_vocab = int(student.config.vocab_size), int(teacher.config.vocab_size)
    per_token = kept + 8 * hidden + (2 * t_mlp + 4 * t_hidden) * t_width
    per_position = 2 * s_vocab * width + t_vocab * t_width + _cache_bytes_per_position(cache, min(s_vocab, t_vocab))
    return RowCost(per_token, per_position, 0.0, chunk_bytes_per_position=10.0 * s_vocab * 4, chunk_size=loss_chunk_size)


def packed_row_cost(student: torch.nn.Module, teacher: torch.nn.Module, loss_chunk_size: int) -> RowCost:
    """The estimate for the packed path (:mod:`rollout.opsd.packed`): per real token as :func:`row_cost`;
    per loss position the student's and the teacher's hidden states, the former's gradient and the cache
    (``[N, H]`` each, no logits); per micro-batch the fused loss's chunk scratch (``[chunk, V]`` float32
    temporaries and bf16 logits) and its float32 head-gradient accumulator (``V * H * 4``)."""
    padded = row_cost(student, teacher, LogitCacheConfig(), loss_chunk_size)
    _, hidden, _ = _dims(student.config)
    _, t_hidden, _ = _dims(teacher.config)
    width, t_width = _param_bytes(student), _param_bytes(teacher)
    s_vocab = int(student.config.vocab_size)
    per_position = 3 * hidden * width + 2 * t_hidden * t_width
    return RowCost(padded.bytes_per_token, per_position, s_vocab * hidden * 4.0, packed=True,
                   chunk_bytes_per_position=12.0 * s_vocab * 4, chunk_size=loss_chunk_size)


def budget_bytes(max_micro_batch_gib: Optional[float], device: torch.device, packed: bool = False) -> float:
    """The micro-batch budget: the configured GiB, or the default of the module docstring (``packed``:
    :data:`PACKED_FREE_FRACTION` of the free memory)."""
    if max_micro_batch_gib is not None:
        return max_micro_batch_gib * GIB
    if device.type != "cuda":
        return CPU_MICRO_BATCH_GIB * GIB
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return (PACKED_FREE_FRACTION if packed else AUTO_FREE_FRACTION) * (free + cached)

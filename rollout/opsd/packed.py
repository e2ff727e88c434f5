"""Packed training forwards: a micro-batch's rows as one sequence, with variable-length causal attention.

The padded path feeds ``[rows, columns]`` with an attention mask: every row pays for the micro-batch's
longest row, SDPA cannot take its flash kernel under a mask, and the kernel it takes instead (cuDNN on
recent PyTorch) builds kernels for every new shape (29 ms of host time a call at the 3B shape). Here the
real tokens of the rows are concatenated into ``[1, total]`` with positions restarting per row, and the
HF model runs with the attention function :data:`ATTENTION` (registered through transformers'
``AttentionInterface``): on CUDA in half precision FlashAttention-2's variable-length kernel
(``aten::_flash_attention_forward`` with ``cu_seqlens``; built ahead of time, no per-shape compilation),
elsewhere a causal SDPA per row (the CPU tests' path). No token attends across a row boundary, so every
hidden state equals the padded path's.

The model's attention setting is switched only for the packed forward (:func:`packed_attention`) and
restored after it: the student is shared with the rollout. The forward keeps no logits: the head runs on
zero positions (``logits_to_keep`` an empty index) and a forward hook on the decoder stack returns its
final (normed) hidden states, read at the loss positions only (:func:`loss_hidden`); the head is applied
chunk by chunk in the loss (:mod:`rollout.opsd.fused_loss`).
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

#: The attention implementation name registered with transformers.
ATTENTION = "opsd_packed"
#: Model types whose HF forward is a plain decoder on transformers' attention interface, with an
#: untransformed linear head (no logit soft-capping or scaling): the packed path covers these.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


@dataclass(frozen=True)
class PackLayout:
    """Where each row of a packed micro-batch lies in the ``[1, total]`` sequence."""

    cu_seqlens: torch.Tensor
    """``[rows + 1]`` int32 on the device: row starts, then the total."""
    lengths: tuple[int, ...]
    """Real tokens of each row (host)."""

    @property
    def total(self) -> int:
        return sum(self.lengths)

    @property
    def max_len(self) -> int:
        return max(self.lengths)


#: The layout of each model config inside :func:`packed_attention` (by ``id``). A plain dict, not a context
#: variable: backward (and an activation-checkpointed layer's recomputation) runs on autograd's threads.
_LAYOUTS: dict[int, PackLayout] = {}


#: Whether CUDA half-precision inputs take FlashAttention's varlen kernel (False: the per-row SDPA path, for checks).
USE_FLASH = True


def _flash_usable(query: torch.Tensor) -> bool:
    return (USE_FLASH and query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and query.shape[-1] <= 256
            and hasattr(torch.ops.aten, "_flash_attention_forward")
            and torch.cuda.get_device_capability(query.device)[0] >= 8)


class _FlashVarlen(torch.autograd.Function):
    """FlashAttention-2 variable-length causal attention (``[T, H, D]`` inputs; GQA native)."""

    @staticmethod
    def forward(ctx, query, key, value, cu_seqlens, max_len, scale):
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            query, key, value, cu_seqlens, cu_seqlens, max_len, max_len, 0.0, True, False, scale=scale)
        ctx.save_for_backward(query, key, value, out, lse, cu_seqlens, rng, unused)
        ctx.max_len, ctx.scale = max_len, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse, cu_seqlens, rng, unused = ctx.saved_tensors
        grads = torch.ops.aten._flash_attention_backward(
            grad_out.contiguous(), query, key, value, out, lse, cu_seqlens, cu_seqlens, ctx.max_len, ctx.max_len,
            0.0, True, rng, unused, scale=ctx.scale)
        return grads[0], grads[1], grads[2], None, None, None


def varlen_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: PackLayout,
                            scale: Optional[float]) -> torch.Tensor:
    """Causal attention within each row of a packed ``[T, H, D]`` sequence (``key``/``value`` may have
    fewer heads, a divisor of the query's); returns ``[T, H_q, D]``."""
    if _flash_usable(query):
        return _FlashVarlen.apply(query.contiguous(), key.contiguous(), value.contiguous(), layout.cu_seqlens,
                                  layout.max_len, scale)
    groups = query.shape[1] // key.shape[1]
    outputs, start = [], 0
    for length in layout.lengths:  # one causal SDPA per row: [1, H, L, D]
        rows = slice(start, start + length)
        q, k, v = (t[rows].transpose(0, 1)[None] for t in (query, key, value))
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        outputs.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)[0].transpose(0, 1))
        start += length
    return torch.cat(outputs)


def _attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, sliding_window=None,
               **kwargs):
    """transformers' attention-function signature: ``query`` ``[1, H, T, D]`` -> ``([1, T, H, D], None)``."""
    layout = _LAYOUTS.get(id(module.config))
    if layout is None:
        raise RuntimeError(f"attention {ATTENTION!r} runs only inside rollout.opsd.packed.packed_attention")
    if sliding_window is not None or (dropout and module.training):
        raise RuntimeError(f"attention {ATTENTION!r} supports neither sliding windows nor attention dropout")
    out = varlen_causal_attention(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                                  layout, scaling)
    return out[None], None


def _no_mask(*args, **kwargs):
    """The mask function of :data:`ATTENTION`: rows are separated by the layout, no mask is built."""
    return None


def register() -> None:
    """Register :data:`ATTENTION` with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register(ATTENTION, _attention)
    AttentionMaskInterface.register(ATTENTION, _no_mask)


def config_unsupported_reason(config) -> Optional[str]:
    """Why the packed path cannot run a model of this HF config (None: its config allows it): its type or
    sliding-window attention (the main job checks it before building the models)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}"
    # Qwen's configs keep a window size that they use only with use_sliding_window; the others use any they hold.
    if model_type in ("qwen2", "qwen3"):
        windowed = bool(getattr(config, "use_sliding_window", False))
    else:
        windowed = getattr(config, "sliding_window", None) is not None
    if windowed or any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return "sliding-window attention"
    return None


def unsupported_reason(causal_lm: torch.nn.Module) -> Optional[str]:
    """Why the packed path cannot run this HF causal LM (None: it can)."""
    reason = config_unsupported_reason(getattr(causal_lm, "config", None))
    if reason is not None:
        return reason
    if "logits_to_keep" not in inspect.signature(type(causal_lm).forward).parameters:
        return f"{type(causal_lm).__name__}.forward takes no logits_to_keep"
    head = getattr(causal_lm, "lm_head", None)
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return "the head is not a bias-free torch.nn.Linear (e.g. an adapter on lm_head)"
    if not isinstance(getattr(causal_lm, getattr(causal_lm, "base_model_prefix", ""), None), torch.nn.Module):
        return "no decoder stack under base_model_prefix"
    return None


@contextlib.contextmanager
def packed_attention(causal_lm: torch.nn.Module, layout: PackLayout) -> Iterator[None]:
    """Run ``causal_lm`` with :data:`ATTENTION` over ``layout`` within the block (hold it through backward when
    layers are recomputed there), then restore its setting."""
    register()
    config = causal_lm.config
    if id(config) in _LAYOUTS:
        raise RuntimeError("packed_attention is already active on this model")
    before = config._attn_implementation
    _LAYOUTS[id(config)] = layout
    config._attn_implementation = ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before
        _LAYOUTS.pop(id(config), None)


@dataclass(frozen=True)
class PackedRows:
    """A micro-batch's rows packed (see :func:`pack`)."""

    input_ids: torch.Tensor
    """``[1, T]`` the real tokens of every row, row after row."""
    position_ids: torch.Tensor
    """``[1, T]`` positions restarting at 0 in each row (as the padded path counts real tokens)."""
    layout: PackLayout
    loss_index: torch.Tensor
    """``[N]`` the loss positions' indices into the packed sequence, row-major (the teacher cache's order)."""


def pack(ids: torch.Tensor, mask: torch.Tensor, loss_mask: torch.Tensor) -> PackedRows:
    """Pack ``[n, S]`` rows; ``loss_mask`` ``[n, k]`` marks loss positions among each row's last ``k``
    columns. One host sync (the rows' lengths)."""
    real = mask != 0
    count = real.long().cumsum(1)  # [n, S]
    lengths = count[:, -1].tolist()
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=ids.device)
    cu[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0).to(ids.device)
    layout = PackLayout(cu, tuple(int(n) for n in lengths))
    positions = (count - 1)[real][None]
    packed_at = count - 1 + cu[:-1, None].long()  # [n, S]: each real token's index in the packed sequence
    loss_index = packed_at[:, ids.shape[1] - loss_mask.shape[1]:][loss_mask.bool()]
    return PackedRows(ids[real][None], positions, layout, loss_index)


def decoder_of(causal_lm: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack (``causal_lm.model`` for Llama/Qwen): its output is the normed hidden state."""
    return getattr(causal_lm, causal_lm.base_model_prefix)


def head_weight(causal_lm: torch.nn.Module) -> torch.Tensor:
    """The head's ``[V, H]`` weight (the parameter itself: its gradient accumulates as usual). Under ZeRO-3 it is
    a partition: read it inside :func:`through_head` (the student's) or ``rollout.model.zero.gathered(head, "once")``
    (a frozen teacher's)."""
    return causal_lm.lm_head.weight


def through_head(causal_lm: torch.nn.Module, fn, *inputs: torch.Tensor):
    """``fn(head weight, *inputs)`` run as the head module's own forward: the module's hooks run around it, so under
    ZeRO-3 the weight is gathered for the call and again for its backward, and its gradient is reduced into the
    partition as after the head's own forward (the fused loss reads the head outside HF's forward). Elsewhere it is
    ``fn(weight, *inputs)`` with the module's other hooks."""
    head = causal_lm.lm_head
    own = head.__dict__.get("forward")  # a forward another library set on the instance, restored after
    head.forward = lambda *args: fn(head.weight, *args)
    try:
        return head(*inputs)
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own


def loss_hidden(model, causal_lm: torch.nn.Module, rows: PackedRows) -> torch.Tensor:
    """Final hidden states ``[N, H]`` at the loss positions of packed ``rows``; call it inside
    :func:`packed_attention` over ``rows.layout``. ``model`` is what is called (a DeepSpeed engine, a peft
    model or ``causal_lm`` itself); gradients flow when grad is enabled."""
    captured = []
    handle = decoder_of(causal_lm).register_forward_hook(lambda _m, _i, out: captured.append(out[0]))
    none = torch.zeros(0, dtype=torch.long, device=rows.input_ids.device)
    try:
        model(input_ids=rows.input_ids, position_ids=rows.position_ids, attention_mask=None, use_cache=False,
              logits_to_keep=none)
    finally:
        handle.remove()
    return captured[-1][0, rows.loss_index]  # [N, H]

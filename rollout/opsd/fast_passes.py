"""The packed passes through the rollout's own decoder pieces instead of HF's layers.

HF's layer code launches a dozen small elementwise kernels per layer around its GEMMs (RMSNorm in five, rotary in
six, SiLU, the residual adds), and as many again in backward. The rollout's pieces (:mod:`rollout.model.pieces`:
norm + q/k/v projections + rotary in one function, o projection + residual + norm + SiLU MLP + residual in the
other) compute exactly what HF's Llama/Qwen2/Mistral layers compute; ``torch.compile`` fuses their elementwise
work, forward and (through AOTAutograd) backward, while the GEMMs stay cuBLAS's. Attention is
:func:`rollout.opsd.packed.varlen_causal_attention` over the packed rows.

- **Teacher** (:func:`fast_parts`, :func:`fast_loss_hidden`): a no-grad forward over plain views of the weights,
  the final norm at the loss positions only.
- **Student** (:func:`student_parts`, :func:`student_decoder`): the same layers over the parameters themselves,
  with autograd, in place of the decoder stack's forward for one call, so that the call still goes through the
  DeepSpeed engine or peft wrapper around the model, and gradients accumulate into the parameters as HF's forward
  would. Its compiled pieces are separate functions (their own code objects: dynamo's compiled graphs and
  recompilation counts are kept per code object), so the training graphs never evict the rollout's.

Both return None where the pieces do not cover the model exactly, and the step runs HF's packed forward instead.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

from rollout.model.pieces import attention_inputs, attention_output_and_mlp
from rollout.model.step import (StepFns, StepParts, compile_piece, compiled_step_fns, layer_output, layer_qkv,
                                rotary, spec_and_weights, unsupported_reason)
from rollout.model.zero import is_zero3
from rollout.opsd.packed import PackedRows, decoder_of, varlen_causal_attention
from rollout.opsd.sizing import is_checkpointing
from rollout.ops.norm import rms_norm


def fast_parts(causal_lm: torch.nn.Module, device: torch.device) -> Optional[StepParts]:
    """The teacher's pieces over ``causal_lm``'s weights (plain views; compiled on CUDA, one graph for every
    layer), or None where they do not cover the model exactly (its type, an unfused LoRA adapter, ZeRO-3)."""
    if unsupported_reason(causal_lm) is not None or is_zero3(causal_lm):
        return None
    spec, weights = spec_and_weights(causal_lm)
    return StepParts(spec, weights, compiled_step_fns() if device.type == "cuda" else StepFns())


def _decoder_stack(parts: StepParts, rows: PackedRows) -> torch.Tensor:
    """Hidden states ``[T, H]`` after the last layer (before the final norm) of the packed tokens of ``rows``."""
    spec, weights, fns = parts.spec, parts.weights, parts.fns
    h = F.embedding(rows.input_ids[0], weights.embed)  # [T, H]
    cos, sin = rotary(rows.position_ids[0], weights.inv_freq, spec.attention_scaling, h.dtype)
    scale = spec.head_dim ** -0.5
    for w in weights.layers:
        q, k, v = layer_qkv(fns, h, w, cos, sin, spec)  # q [T, Hq, 1, D], k/v [T, Hkv, 1, D]
        attn = varlen_causal_attention(q[:, :, 0], k[:, :, 0], v[:, :, 0], rows.layout, scale)
        h = layer_output(fns, h, attn.unsqueeze(2), w, spec.rms_eps)
    return h


def fast_loss_hidden(parts: StepParts, rows: PackedRows) -> torch.Tensor:
    """Final (normed) hidden states ``[N, H]`` at the loss positions of ``rows`` through ``parts``
    (:func:`fast_parts`); the final norm runs at those positions only. The teacher's forward on the packed path."""
    h = _decoder_stack(parts, rows)
    return rms_norm(h.index_select(0, rows.loss_index), parts.weights.final_norm, parts.spec.rms_eps)  # [N, H]


# Their own code objects (see the module docstring); dynamo inlines the piece each calls.
def _train_attention_inputs(*args, **kwargs):
    return attention_inputs(*args, **kwargs)


def _train_attention_output_and_mlp(*args, **kwargs):
    return attention_output_and_mlp(*args, **kwargs)


#: Inductor's mix-order reduction (the RMSNorm backward's row and column sums in one kernel) decides by the token
#: count whether to fuse and guards on it (``2560 <= T <= 4095``, ``4096 <= T`` at the 3B's width: ``T * H >= 5 * 2**20``,
#: ``T >= 4096``), so micro-batches of other sizes recompiled both pieces, forward and backward, 0.5-1 s each, in the
#: first two steps at RL scale. The first setting this torch's inductor knows is used: non-strict mode skips those size
#: checks (one dynamic graph for every count); else the fusion is off (one more read of each norm's input in
#: backward); a torch without the mix-order reduction has no such guards.
TRAIN_INDUCTOR_CHOICES = ({"triton.mix_order_reduction_non_strict_mode": True}, {"triton.mix_order_reduction": False})


def _knows(config, key: str) -> bool:
    section, _, name = key.rpartition(".")
    holder = getattr(config, section, None) if section else config
    return holder is not None and hasattr(holder, name)


def train_compile_options() -> dict:
    """The first of :data:`TRAIN_INDUCTOR_CHOICES` whose settings this torch's inductor knows (an unknown one fails
    ``torch.compile``); ``{}`` when none."""
    try:
        from torch._inductor import config
    except ImportError:  # pragma: no cover - torch without inductor
        return {}
    return next((dict(choice) for choice in TRAIN_INDUCTOR_CHOICES if all(_knows(config, k) for k in choice)), {})


@functools.lru_cache(maxsize=None)
def compiled_train_fns() -> StepFns:
    """The student's pieces ``torch.compile``d (forward and backward), apart from the rollout's, with
    :func:`train_compile_options`."""
    options = train_compile_options()
    return StepFns(attention_inputs=compile_piece(_train_attention_inputs, options=options),
                   attention_output_and_mlp=compile_piece(_train_attention_output_and_mlp, options=options))


def student_unsupported_reason(causal_lm: torch.nn.Module) -> Optional[str]:
    """Why the student's packed pass cannot run through the pieces (None: it can)."""
    reason = unsupported_reason(causal_lm)
    if reason is None and is_zero3(causal_lm):
        reason = "ZeRO-3 partitioned parameters (the pieces read every weight outside the modules' forwards)"
    if reason is None and is_checkpointing(causal_lm):
        reason = "activation checkpointing is on (HF's layers recompute in backward)"
    if reason is None and float(getattr(causal_lm.config, "attention_dropout", 0.0) or 0.0) > 0.0:
        reason = f"attention_dropout {causal_lm.config.attention_dropout}"
    return reason


def student_parts(causal_lm: torch.nn.Module, device: torch.device) -> StepParts:
    """The student's pieces over its parameters themselves (compiled on CUDA); check
    :func:`student_unsupported_reason` first."""
    spec, weights = spec_and_weights(causal_lm, trainable=True)
    return StepParts(spec, weights, compiled_train_fns() if device.type == "cuda" else StepFns())


@contextlib.contextmanager
def student_decoder(causal_lm: torch.nn.Module, parts: StepParts, rows: PackedRows) -> Iterator[None]:
    """Within the block, the decoder stack's forward runs ``rows`` through ``parts`` (whatever inputs it is
    called with) and returns their final hidden states ``[1, T, H]`` as HF's does, so that
    :func:`rollout.opsd.packed.loss_hidden` reads them through the model's usual call."""
    from transformers.modeling_outputs import BaseModelOutputWithPast
    decoder = decoder_of(causal_lm)
    own = decoder.__dict__.get("forward")  # an instance forward set by someone else (restored after)

    def forward(*args, **kwargs):
        h = rms_norm(_decoder_stack(parts, rows), parts.weights.final_norm, parts.spec.rms_eps)
        return BaseModelOutputWithPast(last_hidden_state=h[None])

    decoder.forward = forward
    try:
        yield
    finally:
        if own is None:
            del decoder.forward
        else:
            decoder.forward = own

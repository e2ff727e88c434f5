"""The packed passes through the rollout's own decoder pieces instead of HF's layers.

HF's layer code launches a dozen small elementwise kernels per layer around its GEMMs (RMSNorm in five, rotary in
six, SiLU, the residual adds), and as many again in backward. The rollout's pieces (:mod:`rollout.model.pieces`:
norm + q/k/v projections + rotary in one function, o projection + residual + norm + SiLU MLP + residual in the
other) compute exactly what HF's Llama/Qwen2/Mistral layers compute; ``torch.compile`` fuses their elementwise
work, forward and (through AOTAutograd) backward, while the GEMMs stay cuBLAS's. Attention is
:func:`rollout.opsd.packed.varlen_causal_attention` over the packed rows.

- **Teacher** (:func:`fast_parts`, :func:`fast_loss_hidden`): a no-grad forward over plain views of the weights
  (and of a LoRA model's adapters, through the LoRA pieces below), the final norm at the loss positions only.
- **Student** (:func:`student_parts`, :func:`student_decoder`): the same layers over the parameters themselves,
  with autograd, in place of the decoder stack's forward for one call, so that the call still goes through the
  DeepSpeed engine or peft wrapper around the model, and gradients accumulate into the parameters as HF's forward
  would. Its compiled pieces are separate functions (their own code objects: dynamo's compiled graphs and
  recompilation counts are kept per code object), so the training graphs never evict the rollout's. A peft LoRA
  student runs the LoRA pieces (:func:`rollout.model.pieces.lora_attention_inputs` and
  :func:`~rollout.model.pieces.lora_attention_output_and_mlp`): its frozen base weights and each projection's
  adapter (:func:`rollout.model.lora.training_adapters`) as peft's unmerged forward computes them, so gradients
  reach the adapters only.

Both return None where the pieces do not cover the model exactly, and the step runs HF's packed forward instead.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

from rollout.model.lora import NO_ADAPTERS, Adapter, TrainingAdapters, lora_layers, training_adapters
from rollout.model.pieces import (attention_inputs, attention_output_and_mlp, lora_attention_inputs,
                                  lora_attention_output_and_mlp)
from rollout.model.step import (StepFns, StepParts, compile_piece, layer_output, layer_qkv, rotary, spec_and_weights,
                                unsupported_reason)
from rollout.model.zero import is_zero3
from rollout.opsd.packed import PackedRows, decoder_of, varlen_causal_attention
from rollout.opsd.sizing import is_checkpointing
from rollout.ops.norm import rms_norm


def fast_parts(causal_lm: torch.nn.Module, device: torch.device) -> Optional["PassParts"]:
    """The teacher's pieces over ``causal_lm``'s weights (plain views; compiled on CUDA, one graph for every
    layer) and its active LoRA adapters (a LoRA student distilling from itself), or None where they do not cover the
    model exactly (its type, a LoRA variant, ZeRO-3)."""
    present = lora_layers(causal_lm)
    if is_zero3(causal_lm) or unsupported_reason(causal_lm, fused=present) is not None:
        return None
    adapters = training_adapters(causal_lm, present, evaluating=True)  # the teacher runs in eval mode
    if adapters.reason is not None:
        return None
    spec, weights = spec_and_weights(causal_lm)
    cuda = device.type == "cuda"
    plain = tuple(tuple(None if a is None else Adapter(a.down.detach(), a.up.detach(), a.scale) for a in layer)
                  for layer in adapters.layers)  # plain views, as the weights
    return _pass_parts(StepParts(spec, weights, compiled_teacher_fns() if cuda else StepFns()), plain, cuda)


@dataclass(frozen=True)
class LoraFns:
    """The LoRA pieces (eager, or ``torch.compile``d by :func:`compiled_lora_fns`)."""

    attention_inputs: object = lora_attention_inputs
    attention_output_and_mlp: object = lora_attention_output_and_mlp


@dataclass(frozen=True)
class PassParts:
    """What a pass through the pieces reads: the pieces over the (base) weights, and a LoRA model's adapters."""

    step: StepParts
    adapters: tuple = ()
    """Per decoder layer, an ``Adapter`` or None per projection (:data:`rollout.model.lora.PROJECTIONS`); () without
    LoRA."""
    lora_fns: Optional[LoraFns] = None


def _pass_parts(step: StepParts, adapters: tuple, compiled: bool) -> PassParts:
    """``step``'s pieces, and the LoRA pieces for ``adapters`` (``compiled``: as on CUDA) where there are any."""
    return PassParts(step, adapters, compiled_lora_fns() if compiled else LoraFns()) if adapters else PassParts(step)


def _adapter_arguments(adapters: tuple, names: str) -> dict:
    """The LoRA pieces' keyword arguments of ``adapters`` (one per letter of ``names``: ``a<x>``/``u<x>`` the
    ``lora_A``/``lora_B`` weights or None, and ``scales``)."""
    out = {"scales": tuple(0.0 if adapter is None else adapter.scale for adapter in adapters)}
    for name, adapter in zip(names, adapters):
        out["a" + name], out["u" + name] = (None, None) if adapter is None else (adapter.down, adapter.up)
    return out


def _lora_layer(fns: LoraFns, h, w, adapters: tuple, *, cos, sin, spec, rows: PackedRows, scale: float):
    """One decoder layer with its LoRA updates (``adapters``: q, k, v, o, gate, up, down)."""
    q, k, v = fns.attention_inputs(h, w.input_norm, w.q, w.q_bias, w.k, w.k_bias, w.v, w.v_bias, cos=cos, sin=sin,
                                   **_adapter_arguments(adapters[:3], "qkv"), **spec.piece_constants)
    attn = varlen_causal_attention(q[:, :, 0], k[:, :, 0], v[:, :, 0], rows.layout, scale).unsqueeze(2)
    _any_token_count(attn)
    return fns.attention_output_and_mlp(h, attn, w.o, w.o_bias, w.post_norm, w.gate, w.up, w.down,
                                        **_adapter_arguments(adapters[3:], "ogud"), eps=spec.rms_eps)


def _any_token_count(*tensors: torch.Tensor) -> None:
    """Mark dim 0 (the packed tokens) of the pieces' inputs dynamic for ``torch.compile``, so that their first
    compile already serves every micro-batch size: left to dynamo, the first compile specialises on the first
    count and the second count compiles each piece again, forward and backward (the first steps paid 1-2.5 s for it
    on the H200, docs/BENCHMARKS.md). A hint only: eager pieces ignore it, and a dim that must be static stays so."""
    for tensor in tensors:
        torch._dynamo.maybe_mark_dynamic(tensor, 0)


def _final_hidden(parts: PassParts, rows: PackedRows, index: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Final (normed) hidden states of the packed tokens of ``rows`` through ``parts``: ``[T, H]``, or at the
    positions ``index`` only (the final norm runs there only)."""
    h = _decoder_stack(parts, rows)
    h = h if index is None else h.index_select(0, index)
    return rms_norm(h, parts.step.weights.final_norm, parts.step.spec.rms_eps)


def _decoder_stack(parts: PassParts, rows: PackedRows) -> torch.Tensor:
    """Hidden states ``[T, H]`` after the last layer (before the final norm) of the packed tokens of ``rows``."""
    adapters, lora_fns = parts.adapters, parts.lora_fns
    spec, weights, fns = parts.step.spec, parts.step.weights, parts.step.fns
    h = F.embedding(rows.input_ids[0], weights.embed, padding_idx=spec.padding_idx)  # [T, H]; as HF's gradient
    cos, sin = rotary(rows.position_ids[0], weights.inv_freq, spec.attention_scaling, h.dtype)
    _any_token_count(cos, sin)
    scale = spec.head_dim ** -0.5
    for index, w in enumerate(weights.layers):
        _any_token_count(h)
        if adapters:
            h = _lora_layer(lora_fns, h, w, adapters[index], cos=cos, sin=sin, spec=spec, rows=rows, scale=scale)
            continue
        q, k, v = layer_qkv(fns, h, w, cos, sin, spec)  # q [T, Hq, 1, D], k/v [T, Hkv, 1, D]
        attn = varlen_causal_attention(q[:, :, 0], k[:, :, 0], v[:, :, 0], rows.layout, scale).unsqueeze(2)
        _any_token_count(attn)
        h = layer_output(fns, h, attn, w, spec.rms_eps)
    return h


def fast_loss_hidden(parts: "PassParts", rows: PackedRows) -> torch.Tensor:
    """Final (normed) hidden states ``[N, H]`` at the loss positions of ``rows`` through ``parts``
    (:func:`fast_parts`); the final norm runs at those positions only. The teacher's forward on the packed path."""
    return _final_hidden(parts, rows, rows.loss_index)  # [N, H]


# Their own code objects (see the module docstring); dynamo inlines the piece each calls.
def _teacher_attention_inputs(*args, **kwargs):
    return attention_inputs(*args, **kwargs)


def _teacher_attention_output_and_mlp(*args, **kwargs):
    return attention_output_and_mlp(*args, **kwargs)


@functools.lru_cache(maxsize=None)
def compiled_teacher_fns() -> StepFns:
    """The teacher's pieces ``torch.compile``d as the rollout's are (its default mode), apart from them: its graphs
    take any token count from the first compile (:func:`_any_token_count`), which the rollout's static shapes
    should not share."""
    return StepFns(attention_inputs=compile_piece(_teacher_attention_inputs),
                   attention_output_and_mlp=compile_piece(_teacher_attention_output_and_mlp))


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
def compiled_lora_fns() -> LoraFns:
    """The LoRA pieces ``torch.compile``d as :func:`compiled_train_fns` compiles the others."""
    options = train_compile_options()
    return LoraFns(compile_piece(lora_attention_inputs, options=options),
                   compile_piece(lora_attention_output_and_mlp, options=options))


@functools.lru_cache(maxsize=None)
def compiled_train_fns() -> StepFns:
    """The student's pieces ``torch.compile``d (forward and backward), apart from the rollout's, with
    :func:`train_compile_options`."""
    options = train_compile_options()
    return StepFns(attention_inputs=compile_piece(_train_attention_inputs, options=options),
                   attention_output_and_mlp=compile_piece(_train_attention_output_and_mlp, options=options))


def student_unsupported_reason(causal_lm: torch.nn.Module) -> Optional[str]:
    """Why the student's packed pass cannot run through the pieces (None: it can)."""
    return student_check(causal_lm)[0]


def student_check(causal_lm: torch.nn.Module, gathered: bool = False) -> tuple[Optional[str], TrainingAdapters]:
    """:func:`student_unsupported_reason` and, where it is None, the adapters the pass computes (for
    :func:`student_parts`: one read of a model's modules a step, not two). ``gathered``: the caller holds a ZeRO-3
    student's parameters gathered for the whole pass (:meth:`rollout.opsd.OPSDStep` does under ``gather="once"``),
    so the pieces may read them outside the modules' forwards."""
    # everything but the adapters, then the adapters: the LoRA pieces compute what peft's unmerged layers do
    present = lora_layers(causal_lm)
    reason = unsupported_reason(causal_lm, fused=present)
    adapters = training_adapters(causal_lm, present) if reason is None else NO_ADAPTERS
    if reason is None and adapters.reason is not None:
        reason = f"LoRA: {adapters.reason}"
    if reason is None and not gathered and is_zero3(causal_lm):
        reason = ("ZeRO-3 partitioned parameters, gathered per module (gather='per_forward'): the pieces read every "
                  "weight outside the modules' forwards")
    if reason is None and is_checkpointing(causal_lm):
        reason = "activation checkpointing is on (HF's layers recompute in backward)"
    if reason is None and float(getattr(causal_lm.config, "attention_dropout", 0.0) or 0.0) > 0.0:
        reason = f"attention_dropout {causal_lm.config.attention_dropout}"
    return reason, adapters


def student_parts(causal_lm: torch.nn.Module, device: torch.device,
                  adapters: Optional[TrainingAdapters] = None) -> PassParts:
    """The student's pieces over its parameters themselves (a LoRA student's base weights, and its adapters;
    compiled on CUDA); check :func:`student_unsupported_reason` first (:func:`student_check` also returns the
    ``adapters``; None: read them here)."""
    spec, weights = spec_and_weights(causal_lm, trainable=True)
    cuda = device.type == "cuda"
    adapters = training_adapters(causal_lm) if adapters is None else adapters
    return _pass_parts(StepParts(spec, weights, compiled_train_fns() if cuda else StepFns()), adapters.layers, cuda)


@contextlib.contextmanager
def student_decoder(causal_lm: torch.nn.Module, parts: PassParts, rows: PackedRows) -> Iterator[None]:
    """Within the block, the decoder stack's forward runs ``rows`` through ``parts`` (whatever inputs it is
    called with) and returns their final hidden states ``[1, T, H]`` as HF's does, so that
    :func:`rollout.opsd.packed.loss_hidden` reads them through the model's usual call."""
    from transformers.modeling_outputs import BaseModelOutputWithPast
    decoder = decoder_of(causal_lm)
    own = decoder.__dict__.get("forward")  # an instance forward set by someone else (restored after)

    def forward(*args, **kwargs):
        return BaseModelOutputWithPast(last_hidden_state=_final_hidden(parts, rows)[None])

    decoder.forward = forward
    try:
        yield
    finally:
        if own is None:
            del decoder.forward
        else:
            decoder.forward = own

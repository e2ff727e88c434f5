"""A decode step of our own for Llama-family models (Llama, Qwen2, Mistral), read from the HF modules.

Why: HF's layer code launches dozens of small kernels per layer; even replayed from a CUDA graph a
3B-shaped decode step stays ~6x the memory-bandwidth floor. This step computes exactly what the HF
layers compute (RMSNorm, rotary, grouped-query attention over our static cache, SiLU MLP) with two
fusable pieces per layer (``attention_inputs``, ``attention_output_and_mlp``) that
``compiled_step_fns`` compiles with ``torch.compile`` and :mod:`rollout.executors.graphs` captures in
CUDA graphs. On the CPU it runs eagerly and is checked against HF ``generate`` in the tests.

The weights are the model's own parameter tensors (no copy), so LoRA must be fused (peft's unmerged
forward is not replicated here) and the addresses are part of the graph key.

The weight records and kept copies are in :mod:`rollout.model.weights`, the pieces in :mod:`rollout.model.pieces`;
the names the other layers import from here are re-exported (``__all__``).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rollout.model.pieces import (attention_inputs, attention_inputs_qkv, attention_inputs_qkv_write,
                                  attention_output_and_gate_up_mlp, attention_output_and_mlp, final_logits,
                                  gate_up_mlp, gate_up_silu, grouped_decode_attention, qkv_projection, rotary)
from rollout.model.weights import (SUPPORTED_MODEL_TYPES, SUPPORTED_ROPE_TYPES, DecoderSpec, DecoderWeights,
                                   FusedGateUp, FusedQKV, LayerWeights, WeightMirror, kept_buffer, spec_and_weights,
                                   unsupported_reason)
from rollout.ops.decode_attention import sdpa as decode_attention  # the step's default attention piece
from rollout.ops.norm import rms_norm

__all__ = [  # what the other layers import from here (defined here, or in the modules above)
    "SUPPORTED_MODEL_TYPES", "SUPPORTED_ROPE_TYPES", "DecoderSpec", "DecoderWeights", "FusedGateUp", "FusedQKV",
    "LayerWeights", "StepFns", "StepParts", "WeightMirror", "attention_inputs", "attention_inputs_qkv",
    "attention_inputs_qkv_write", "attention_output_and_gate_up_mlp", "attention_output_and_mlp", "compile_piece",
    "compiled_step_fns", "decode_attention", "decode_logits", "final_logits", "gate_up_mlp", "gate_up_silu",
    "grouped_decode_attention", "kept_buffer", "layer_output", "layer_qkv", "qkv_projection", "rms_norm", "rotary",
    "spec_and_weights", "unsupported_reason",
]


def layer_qkv(fns: "StepFns", h, w: LayerWeights, cos, sin, spec: DecoderSpec):
    """q ``[N, Hq, 1, D]``, k/v ``[N, Hkv, 1, D]`` of one layer: one GEMM where ``w.qkv`` is set, else three."""
    if w.qkv is not None:
        return fns.attention_inputs_qkv(h, w.input_norm, w.qkv, w.qkv_bias, cos=cos, sin=sin, **spec.piece_constants)
    return fns.attention_inputs(h, w.input_norm, w.q, w.q_bias, w.k, w.k_bias, w.v, w.v_bias, cos=cos, sin=sin,
                                **spec.piece_constants)


def layer_output(fns: "StepFns", h, attn, w: LayerWeights, eps: float):
    """The layer's output from its attention: one gate|up GEMM where ``w.gate_up`` is set, else two."""
    if w.gate_up is not None:
        return fns.attention_output_and_gate_up_mlp(h, attn, w.o, w.o_bias, w.post_norm, w.gate_up, w.down, eps=eps)
    return fns.attention_output_and_mlp(h, attn, w.o, w.o_bias, w.post_norm, w.gate, w.up, w.down, eps=eps)


def _layer_rest(fns: "StepFns", h, attn, w: LayerWeights, eps: float, skinny: bool):
    """The layer after its attention: o + residual, then the MLP + residual. ``skinny``: o on the skinny kernel;
    ``fns.residual_in_place``: o and down added into ``h`` in place (a tensor of the step's own: its embedding output
    or a layer's)."""
    rows = h.shape[0]
    in_place = fns.residual_in_place and w.gate_up is not None
    if skinny and w.gate_up is not None:  # o + residual in one kernel, then the compiled MLP
        h = fns.skinny_linear(attn.reshape(rows, -1), w.o, w.o_bias, residual=h)
    elif in_place and w.o_bias is None:
        _addmm_(fns, h, attn.reshape(rows, -1), w.o)
    else:
        return layer_output(fns, h, attn, w, eps)
    if in_place and fns.silu_mul_rms is not None:  # the norm's gain folded into w.gate_up
        return _addmm_(fns, h, fns.silu_mul_rms(_mm(fns, h, w.gate_up), h, eps=eps), w.down)
    if in_place:
        return _addmm_(fns, h, fns.gate_up_silu(h, w.post_norm, w.gate_up, eps), w.down)
    return fns.gate_up_mlp(h, w.post_norm, w.gate_up, w.down, eps)


def _mm(fns: "StepFns", x, w):
    """``x @ w.t()`` through ``fns.tuned`` where set, else ``torch.mm``."""
    return fns.tuned.mm(x, w) if fns.tuned is not None else torch.mm(x, w.t())


def _addmm_(fns: "StepFns", h, x, w):
    """``h += x @ w.t()`` in place, through ``fns.tuned`` where set."""
    return fns.tuned.addmm_(h, x, w) if fns.tuned is not None else h.addmm_(x, w.t())


@dataclass(frozen=True)
class StepFns:
    """The fusable pieces (eager functions, or their ``torch.compile``d versions). They take tensors and
    constants only, so one compiled graph serves every layer: the layer's input and weights positionally, the
    rest keyword-only (not records, which would add guards)."""

    attention_inputs: object = attention_inputs
    attention_inputs_qkv: object = attention_inputs_qkv
    attention_output_and_mlp: object = attention_output_and_mlp
    final_logits: object = final_logits
    attention: object = decode_attention
    """Decode attention, left eager: :func:`decode_attention` (SDPA), or on CUDA with
    ``RolloutConfig.kernels.decode_attention="triton"`` the kernel of :mod:`rollout.ops.decode_attention`."""
    attention_inputs_qkv_write: object = None
    """When set (and q|k|v are fused), decode steps write k and v into the cache inside this piece
    (:func:`attention_inputs_qkv_write`) instead of with two ``index_copy_`` after it
    (``RolloutConfig.kernels.fused_kv_write``, compiled pieces only)."""
    attention_output_and_gate_up_mlp: object = attention_output_and_gate_up_mlp
    qkv_projection: object = qkv_projection
    gate_up_mlp: object = gate_up_mlp
    gate_up_silu: object = gate_up_silu
    skinny_linear: object = None
    """When set (with ``rotary_write`` and fused gate|up), decode steps of at most ``skinny_rows`` rows compute each
    layer's o projection and its residual add with this kernel (``RolloutConfig.kernels.skinny_rows``:
    :func:`rollout.ops.skinny_linear.skinny_linear`), then ``gate_up_mlp``; the other projections stay cuBLAS
    GEMMs in the compiled pieces, which were faster there on an H200."""
    skinny_rows: int = 0
    shared_prefix_rows: int = 0
    """Ordinary-route decode steps of at least this many rows, whose prompts have several samples, hand the
    attention piece a ``SharedPrefix`` (``RolloutConfig.kernels.shared_prefix_rows``; 0: never)."""
    first_row_rows: int = 0
    """Of those, steps of at most this many rows read the prompt from each run's first row
    (``RolloutConfig.kernels.shared_prefix_first_row_rows``; 0: never)."""
    residual_in_place: bool = False
    """Decode steps add each layer's o and down projections into the residual stream in place (``addmm_``: the GEMM's
    own beta-add, no copy of the residual first), with the norm, gate|up and SiLU·mul in ``gate_up_silu``, where
    gate|up are fused and o has no bias (``RolloutConfig.kernels.residual_in_place``)."""
    rotary_write: object = None
    """When set (and q|k|v are fused), decode steps compute ``qkv_projection`` and hand it to this function,
    which rotates q and k and writes k and v into the cache (``RolloutConfig.kernels.rotary_kernel``: the one Triton
    kernel of :mod:`rollout.ops.rotary_write`); it takes precedence over ``attention_inputs_qkv_write``."""
    rotary_write_rms: object = None
    """Only where the input norms' gains are folded into the fused q|k|v copies (``RolloutConfig.kernels.fold_norms``):
    decode steps multiply the residual stream itself by the copy (no norm) and hand the product and the residual to
    this function, which scales each row by its 1/RMS, adds the bias, rotates and writes the cache
    (:func:`rollout.ops.rms_scaled.rotary_write_rms`); it takes precedence over ``rotary_write``."""
    rotary_attention: object = None
    """With ``rotary_write_rms`` and the Triton attention: decode steps of at least ``rotary_attention_rows`` rows
    hand the q|k|v product to this function, whose attention kernel rotates its own queries and writes k and v into the
    cache (:func:`rollout.ops.rotary_attention.rotary_attention`), in place of ``rotary_write_rms`` and ``attention``
    (``RolloutConfig.kernels.rotary_in_attention_rows``)."""
    rotary_attention_rows: int = 1
    tuned: object = None
    """With ``RolloutConfig.kernels.blas_library="cublaslt-tuned"`` on CUDA: the projections the step runs outside the
    compiled pieces (q|k|v with folded norms, o and down in place, gate|up) on each shape's fastest cuBLASLt
    algorithm (:class:`rollout.ops.tuned_gemm.TunedGemm`)."""
    silu_mul_rms: object = None
    """Only where the post-attention norms' gains are folded into the fused gate|up copies: with
    ``residual_in_place``, decode steps multiply the residual itself by the copy and take the activation from this
    function (:func:`rollout.ops.rms_scaled.silu_mul_rms`) instead of ``gate_up_silu``."""


def compile_piece(fn, mode: str | None = None, options: dict | None = None):
    """``fn`` compiled as every piece of the step is: one graph, shapes dynamic after a second size, no
    inductor CUDA graphs (ours wrap the whole step). ``mode``: ``RolloutConfig.kernels.compile_mode``; ``options``:
    inductor settings instead of a mode (torch takes one or the other)."""
    if options:
        return torch.compile(fn, dynamic=None, fullgraph=True, options=options)
    return torch.compile(fn, dynamic=None, fullgraph=True, mode=mode)


@functools.lru_cache(maxsize=None)
def compiled_step_fns(mode: str | None = None, kv_write: bool = False) -> StepFns:
    """``torch.compile``d pieces (inductor fuses norms, rotary, SiLU and residual adds). One compiled graph
    serves every layer. ``mode``: the ``torch.compile`` mode (``RolloutConfig.kernels.compile_mode``; None: torch's
    default); ``kv_write``: the fused q|k|v piece also writes k and v into the cache
    (``RolloutConfig.kernels.fused_kv_write``)."""
    fns = StepFns(*(compile_piece(fn, mode) for fn in (attention_inputs, attention_inputs_qkv,
                                                        attention_output_and_mlp, final_logits)),
                  attention_output_and_gate_up_mlp=compile_piece(attention_output_and_gate_up_mlp, mode),
                  qkv_projection=compile_piece(qkv_projection, mode), gate_up_mlp=compile_piece(gate_up_mlp, mode),
                  gate_up_silu=compile_piece(gate_up_silu, mode))
    if kv_write:
        fns = dataclasses.replace(fns, attention_inputs_qkv_write=compile_piece(attention_inputs_qkv_write, mode))
    return fns


@dataclass(frozen=True)
class StepParts:
    """Everything our step functions read besides the cache and the tokens: geometry, weights, pieces."""

    spec: DecoderSpec
    weights: DecoderWeights
    """The model's own tensors (plain views) or, under ZeRO-3 with graphs, the weight mirror's copies."""
    fns: StepFns
    """Eager or ``torch.compile``d pieces (``compiled_step_fns``)."""


def decode_logits(parts: StepParts, key_cache: torch.Tensor, value_cache: torch.Tensor, tokens: torch.Tensor,
                  positions: torch.Tensor, col: torch.Tensor, keep: torch.Tensor, *, start: int = 0,
                  last: torch.Tensor | None = None, shared=None) -> torch.Tensor:
    """One decode step: ``logits [B, V]`` for ``tokens [B]`` at ``positions [B]``, written at cache column ``col``.

    ``key_cache``/``value_cache``: ``[layers, B, Hkv, capacity, D]`` views; ``keep [B, 1, 1, L]`` bool
    selects the keys each row may attend among columns ``[start, start + L)`` (``L`` = the length
    bucket; ``start`` > 0 for the aligned cache of the continuous route, whose dead prefix is skipped).
    ``last`` (a scalar tensor, a column of the window: no row attends past it) and ``shared``
    (``decode_attention.SharedPrefix``: rows that hold one prompt's columns) go to the attention piece, which
    may read less with them (the Triton kernel) or ignore them (SDPA).
    """
    window = {key: value for key, value in (("last", last), ("shared", shared)) if value is not None}
    spec, weights, fns = parts.spec, parts.weights, parts.fns
    live = keep.shape[-1]
    stop = start + live
    h = F.embedding(tokens, weights.embed)  # [B, H]
    cos, sin = rotary(positions, weights.inv_freq, spec.attention_scaling, h.dtype)
    cols = col.view(1)
    eps = spec.rms_eps
    skinny = (fns.skinny_linear is not None and fns.rotary_write is not None and tokens.shape[0] <= fns.skinny_rows)
    scale, gqa = spec.head_dim ** -0.5, spec.num_heads != spec.num_kv_heads
    fused = (fns.rotary_attention is not None and fns.rotary_write_rms is not None
             and tokens.shape[0] >= fns.rotary_attention_rows)
    for i, w in enumerate(weights.layers):
        if fused and w.qkv is not None:
            attn = fns.rotary_attention(_mm(fns, h, w.qkv), h, w.qkv_bias, cos, sin, key_cache[i], value_cache[i],
                                        cols, keep=keep, scale=scale, eps=eps, heads=spec.num_heads,
                                        kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, start=start, stop=stop,
                                        **window)
        else:
            q = _queries_and_cache_write(fns, h, w, cos, sin, key_cache[i], value_cache[i], cols=cols, spec=spec)
            attn = fns.attention(q, key_cache[i, :, :, start:stop], value_cache[i, :, :, start:stop], keep, scale,
                                 gqa, **window)
        h = _layer_rest(fns, h, attn, w, eps, skinny)
    return fns.final_logits(h, weights.final_norm, weights.lm_head, weights.lm_head_bias, eps)


def _queries_and_cache_write(fns: StepFns, h, w: LayerWeights, cos, sin, key_layer, value_layer, *, cols,
                             spec: DecoderSpec):
    """One layer's rotated queries ``[B, Hq, 1, D]`` of a decode step, its k and v written into cache column ``cols``:
    by the rotary kernels where set (``rotary_write_rms``, ``rotary_write``), else the compiled pieces."""
    eps = spec.rms_eps
    if fns.rotary_write_rms is not None and w.qkv is not None:  # the norm's gain folded into w.qkv
        return fns.rotary_write_rms(_mm(fns, h, w.qkv), h, w.qkv_bias, cos, sin, key_layer, value_layer, cols,
                                    eps=eps, heads=spec.num_heads, kv_heads=spec.num_kv_heads, head_dim=spec.head_dim)
    if fns.rotary_write is not None and w.qkv is not None:
        qkv = fns.qkv_projection(h, w.input_norm, w.qkv, w.qkv_bias, eps)
        return fns.rotary_write(qkv, cos, sin, key_layer, value_layer, cols, heads=spec.num_heads,
                                kv_heads=spec.num_kv_heads, head_dim=spec.head_dim)
    if fns.attention_inputs_qkv_write is not None and w.qkv is not None:
        return fns.attention_inputs_qkv_write(h, w.input_norm, w.qkv, w.qkv_bias, cos=cos, sin=sin,
                                              key_layer=key_layer, value_layer=value_layer, cols=cols,
                                              **spec.piece_constants)
    q, k, v = layer_qkv(fns, h, w, cos, sin, spec)
    key_layer.index_copy_(2, cols, k)
    value_layer.index_copy_(2, cols, v)
    return q

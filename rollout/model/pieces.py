"""The fusable pieces of the decode step (:mod:`rollout.model.step`) and of the packed prefill: RMSNorm, the
projections, rotary, the SiLU MLP and the residual adds, as plain tensor functions that ``compiled_step_fns``
compiles with ``torch.compile`` (one compiled graph serves every layer). Each takes the layer's input and weights
positionally and the rest keyword-only: records would add dynamo guards."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rollout.ops.norm import rms_norm


def rotary(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype):
    """``cos, sin [B, 1, 1, D]`` for one position per row."""
    freqs = positions[:, None].float() * inv_freq.float()  # [B, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return ((emb.cos() * scaling).to(dtype)[:, None, None, :], (emb.sin() * scaling).to(dtype)[:, None, None, :])


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


# keyword-only, not records: compiled piece; records would add guards
def attention_inputs(h, norm, wq, bq, wk, bk, wv, bv, *, cos, sin, eps: float, num_heads: int, num_kv_heads: int,
                     head_dim: int):
    """RMSNorm -> q/k/v projections -> rotary. ``h [B, H]`` -> q ``[B, Hq, 1, D]``, k/v ``[B, Hkv, 1, D]``."""
    batch = h.shape[0]
    x = rms_norm(h, norm, eps)
    q = F.linear(x, wq, bq).view(batch, num_heads, 1, head_dim)
    k = F.linear(x, wk, bk).view(batch, num_kv_heads, 1, head_dim)
    v = F.linear(x, wv, bv).view(batch, num_kv_heads, 1, head_dim)
    return _rotate(q, cos, sin), _rotate(k, cos, sin), v


# keyword-only, not records: compiled piece; records would add guards
def attention_inputs_qkv(h, norm, wqkv, bqkv, *, cos, sin, eps: float, num_heads: int, num_kv_heads: int,
                         head_dim: int):
    """:func:`attention_inputs` with one GEMM over the concatenated ``[q; k; v]`` weight."""
    batch = h.shape[0]
    qkv = F.linear(rms_norm(h, norm, eps), wqkv, bqkv)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q.reshape(batch, num_heads, 1, head_dim)
    k = k.reshape(batch, num_kv_heads, 1, head_dim)
    return _rotate(q, cos, sin), _rotate(k, cos, sin), v.reshape(batch, num_kv_heads, 1, head_dim)


# keyword-only, not records: compiled piece; records would add guards
def attention_inputs_qkv_write(h, norm, wqkv, bqkv, *, cos, sin, key_layer, value_layer, cols, eps: float,
                               num_heads: int, num_kv_heads: int, head_dim: int):
    """:func:`attention_inputs_qkv` that also writes the step's k and v into one layer's cache
    (``key_layer``/``value_layer [B, Hkv, capacity, D]``, column ``cols [1]``) and returns q only. Under
    ``torch.compile`` the rotary of q and k and both cache writes become one kernel that writes the cache in
    place (checked on inductor's CPU code: no copy of the cache; one compiled graph serves every layer's
    cache view), where the separate path launches two rotary kernels, two ``index_copy_`` and copies."""
    q, k, v = attention_inputs_qkv(h, norm, wqkv, bqkv, cos=cos, sin=sin, eps=eps, num_heads=num_heads,
                                   num_kv_heads=num_kv_heads, head_dim=head_dim)
    key_layer.index_copy_(2, cols, k)
    value_layer.index_copy_(2, cols, v)
    return q


def qkv_projection(h, norm, wqkv, bqkv, eps: float):
    """RMSNorm -> the fused q|k|v projection ``[B, (Hq + 2 Hkv) D]``, before the rotary (for
    :func:`rollout.ops.rotary_write.rotary_write`, which rotates and writes the cache in one kernel)."""
    return F.linear(rms_norm(h, norm, eps), wqkv, bqkv)


# keyword-only, not records: compiled piece; records would add guards
def attention_output_and_mlp(h, attn, wo, bo, norm, gate, up, down, *, eps: float):
    """o projection + residual, RMSNorm, SiLU MLP + residual. ``attn [B, Hq, 1, D]``."""
    h = h + F.linear(attn.reshape(h.shape[0], -1), wo, bo)
    x = rms_norm(h, norm, eps)
    return h + F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


# keyword-only, not records: compiled piece; records would add guards
def attention_output_and_gate_up_mlp(h, attn, wo, bo, norm, gate_up, down, *, eps: float):
    """:func:`attention_output_and_mlp` with one GEMM over the concatenated ``[gate; up]`` weight."""
    return gate_up_mlp(h + F.linear(attn.reshape(h.shape[0], -1), wo, bo), norm, gate_up, down, eps)


def gate_up_mlp(h, norm, gate_up, down, eps: float):
    """The second half of :func:`attention_output_and_gate_up_mlp`: the MLP and its residual, for a step whose o
    projection ran apart (``StepFns.skinny_linear``)."""
    return h + F.linear(gate_up_silu(h, norm, gate_up, eps), down)


def gate_up_silu(h, norm, gate_up, eps: float):
    """The MLP's activation ``silu(gate) * up`` of ``rms_norm(h)``, one GEMM over ``[gate; up]``: :func:`gate_up_mlp`
    without the down projection and its residual, for a step that adds those into the residual stream in place
    (``StepFns.residual_in_place``)."""
    gate, up = F.linear(rms_norm(h, norm, eps), gate_up).chunk(2, dim=-1)
    return F.silu(gate) * up


def adapted(x, y, down, up, scale: float):
    """``y`` (a projection of ``x``) plus its LoRA update as peft's unmerged ``Linear`` computes it: ``x`` cast to
    the adapter's dtype, ``B(A(x)) * scale``, the sum cast back to ``y``'s dtype. ``down``/``up``: the ``lora_A`` /
    ``lora_B`` weights ``[r, in]`` / ``[out, r]``; None: no adapter (``y`` as it is)."""
    if down is None:
        return y
    return (y + F.linear(F.linear(x.to(down.dtype), down), up) * scale).to(y.dtype)


# keyword-only, not records: compiled piece; records would add guards
def lora_attention_inputs(h, norm, wq, bq, wk, bk, wv, bv, *, aq, uq, ak, uk, av, uv, cos, sin, scales, eps: float,
                          num_heads: int, num_kv_heads: int, head_dim: int):
    """:func:`attention_inputs` with a LoRA update on each projection that has one (:func:`adapted`: ``a*``/``u*``
    the ``lora_A``/``lora_B`` weights or None, ``scales`` their three scalings): a LoRA student's training pass."""
    batch = h.shape[0]
    x = rms_norm(h, norm, eps)
    q = adapted(x, F.linear(x, wq, bq), aq, uq, scales[0]).view(batch, num_heads, 1, head_dim)
    k = adapted(x, F.linear(x, wk, bk), ak, uk, scales[1]).view(batch, num_kv_heads, 1, head_dim)
    v = adapted(x, F.linear(x, wv, bv), av, uv, scales[2]).view(batch, num_kv_heads, 1, head_dim)
    return _rotate(q, cos, sin), _rotate(k, cos, sin), v


# keyword-only, not records: compiled piece; records would add guards
def lora_attention_output_and_mlp(h, attn, wo, bo, norm, gate, up, down, *, ao, uo, ag, ug, au, uu, ad, ud, scales,
                                  eps: float):
    """:func:`attention_output_and_mlp` with a LoRA update on each of o, gate, up and down that has one
    (:func:`adapted`; ``scales`` their four scalings)."""
    a = attn.reshape(h.shape[0], -1)
    h = h + adapted(a, F.linear(a, wo, bo), ao, uo, scales[0])
    x = rms_norm(h, norm, eps)
    m = F.silu(adapted(x, F.linear(x, gate), ag, ug, scales[1])) * adapted(x, F.linear(x, up), au, uu, scales[2])
    return h + adapted(m, F.linear(m, down), ad, ud, scales[3])


def final_logits(h, norm, lm_head, lm_bias, eps: float):
    return F.linear(rms_norm(h, norm, eps), lm_head, lm_bias)


def grouped_decode_attention(q, k, v, keep, scale: float, gqa: bool, *, last=None, shared=None):
    """The step's default attention (:func:`rollout.ops.decode_attention.sdpa`) as two batched GEMMs per KV head
    over its group of query heads (q heads ``h * G .. h * G + G - 1`` share KV head ``h``, as in SDPA's
    ``enable_gqa``): each key and value is read once per KV head, and under ``torch.compile`` the mask and softmax
    fuse into one kernel. Scores are computed in the inputs' dtype and the softmax in fp32, as HF's eager
    attention does. An experiment
    (``python -m benchmarks.decode_step --grouped-attention``), not used by the routes: on an H200 it made the
    compiled 3B step slower (4.08 vs 3.79 ms at 32 rows, 12.8 vs 5.79 at 256)."""
    batch, heads, _, dim = q.shape
    kv_heads, length = k.shape[1], k.shape[2]
    group = heads // kv_heads
    scores = torch.matmul(q.reshape(batch, kv_heads, group, dim), k.transpose(-1, -2)).float() * scale
    keep = keep.reshape(batch, 1, 1, length)
    scores = scores.masked_fill(~keep, float("-inf")) if keep.dtype == torch.bool else scores + keep.float()
    probs = torch.softmax(scores, dim=-1).to(v.dtype)  # [B, Hkv, G, L]
    return torch.matmul(probs, v).reshape(batch, heads, 1, dim)

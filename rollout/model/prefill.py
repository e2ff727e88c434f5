"""A prefill of our own for Llama-family models: packed linear layers, attention per row or per bucket.

Why: through the HF layers a prefill forward of the 3B-shaped model costs ~21 ms before it does any
work (hundreds of small kernels, Python per module), and a padded batch spends its matmuls on padding.
Here every linear layer, norm and MLP runs once over the *packed* real tokens of all rows
(``[T_real, H]``, no padding), using the same fusable pieces as the decode step
(:mod:`rollout.model.step`: a row of the decode step is simply a token here). Attention:

- on CUDA in fp16/bf16, flash attention's variable-length kernel attends causally within each row of
  the packed batch (``torch.nn.attention.varlen``): one kernel per layer, no padding at all, so the
  planner's buckets are not needed (:func:`varlen_attention`);
- elsewhere (CPU, fp32) per prefill bucket: the bucket's queries are scattered into ``[rows, L, ...]``
  and attend over the bucket's cache columns with SDPA, so buckets bound attention work and padding,
  never the number of passes over the weights.

Layout (as :mod:`rollout.ops.masks`): ``prompt_ids [N, T_p]`` left-padded, real tokens of row ``r`` in
columns ``[T_p - len_r, T_p)``; keys/values go to the same cache columns. Padding columns are never
written here: they keep the finite values they held (zeros when new), and masked keys weigh exactly 0.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rollout.model.step import StepParts, layer_output, layer_qkv, rotary
from rollout.ops import masks
from rollout.plan.layout import RowSpans

#: ``(first_row, stop_row, length)``: rows ``[first, stop)`` attend within the last ``length`` columns.
Group = tuple[int, int, int]


def prefill_logits(parts: StepParts, key_cache: torch.Tensor, value_cache: torch.Tensor, prompt_ids: torch.Tensor,
                   prompt_mask: torch.Tensor, groups: list[Group] | None = None,
                   rows: RowSpans | None = None, graphs=None) -> torch.Tensor:
    """Write keys/values of every real prompt token into the cache; return the last column's logits ``[N, V]``.

    ``key_cache``/``value_cache``: ``[layers, N, Hkv, capacity, D]`` (rows of this prefill; columns
    ``[0, T_p)`` are the prompt's). ``groups`` must cover rows ``[0, N)`` in order, each ``length``
    reaching every real token of its rows; None is one group over all rows and columns.
    ``rows``: each row's real-token count and first real column as host ints (the caller's prompt
    layout); without it they are read from ``prompt_mask`` in one host sync. ``graphs``: a
    :class:`rollout.executors.prefill_graph.PrefillGraphs` (``RolloutConfig.kernels.prefill_graph_tokens``) that runs the pass
    from a CUDA graph where it can (it returns None where it cannot, and the pass runs here).
    """
    num_rows, prompt_len = prompt_ids.shape
    groups = groups or [(0, num_rows, prompt_len)]
    packed = _pack(prompt_ids, prompt_mask, rows)
    for first, stop, length in groups:
        if min(packed.rows.first_cols[first:stop]) < prompt_len - length:
            raise ValueError(f"prefill group rows [{first}, {stop}) of length {length} misses real prompt tokens")
    if graphs is not None:
        logits = graphs.run(parts, packed, key_cache, value_cache)
        if logits is not None:
            return logits
    attend = _attention(parts, key_cache, value_cache, packed, prompt_mask, groups)

    def write_kv(layer: int, k, v):
        key_cache[layer].transpose(1, 2)[packed.row_of, packed.col_of] = k[:, :, 0]
        value_cache[layer].transpose(1, 2)[packed.row_of, packed.col_of] = v[:, :, 0]

    last = torch.cumsum(packed.row_lengths, 0) - 1  # each row's last real token (column T_p - 1); no host copy
    return packed_logits(parts, packed.tokens, packed.positions, last, write_kv, attend)


def packed_logits(parts: StepParts, tokens: torch.Tensor, positions: torch.Tensor, last: torch.Tensor,
                  write_kv, attend) -> torch.Tensor:
    """One pass over packed tokens ``[T]`` at ``positions [T]``: every layer's keys/values go to
    ``write_kv(layer, k, v)`` (``k``/``v`` ``[T, Hkv, 1, D]``), its attention is ``attend(layer, q, k, v) ->
    [T, Hq, 1, D]``; returns the logits of the tokens at ``last [N]``. The eager prefill and the captured one
    (:mod:`rollout.executors.prefill_graph`) both run it."""
    spec, weights, fns = parts.spec, parts.weights, parts.fns
    eps = spec.rms_eps
    h = F.embedding(tokens, weights.embed)  # [T, H]
    cos, sin = rotary(positions, weights.inv_freq, spec.attention_scaling, h.dtype)
    for i, w in enumerate(weights.layers):
        q, k, v = layer_qkv(fns, h, w, cos, sin, spec)  # q [T, Hq, 1, D], k/v [T, Hkv, 1, D]
        write_kv(i, k, v)
        h = layer_output(fns, h, attend(i, q, k, v), w, eps)
    return fns.final_logits(h.index_select(0, last), weights.final_norm, weights.lm_head, weights.lm_head_bias, eps)


@dataclass(frozen=True)
class Packed:
    """The real prompt tokens of a left-padded block, packed row after row (``T`` tokens in all)."""

    rows: RowSpans
    offsets: list[int]  # [N + 1] first packed index of each row
    row_lengths: torch.Tensor  # [N] real tokens per row, on the device
    row_of: torch.Tensor  # [T] row of each packed token
    col_of: torch.Tensor  # [T] column of each packed token
    tokens: torch.Tensor  # [T]
    positions: torch.Tensor  # [T] position ids (real-token count - 1)


def _pack(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, rows: RowSpans | None) -> Packed:
    prompt_len = prompt_ids.shape[1]
    real = prompt_mask.bool()
    row_lengths = real.sum(dim=1)  # [N], on the device
    if rows is None:  # one host sync: real tokens and first real column per row
        counts, firsts = torch.stack([row_lengths, real.int().argmax(dim=1)]).tolist()
        rows = RowSpans(tuple(counts), tuple(firsts))
    offsets = [0]
    for n in rows.real_counts:
        offsets.append(offsets[-1] + n)
    flat = torch.nonzero_static(real.flatten(), size=offsets[-1]).squeeze(1)  # [T] packed -> dense index
    positions = masks.prompt_positions(prompt_mask).flatten().index_select(0, flat)
    return Packed(rows, offsets, row_lengths, flat // prompt_len, flat % prompt_len,
                   prompt_ids.flatten().index_select(0, flat), positions)


def _attention(parts: StepParts, key_cache, value_cache, packed: Packed, prompt_mask, groups: list[Group]):
    """``attend(layer, q, k, v) -> [T, Hq, 1, D]``: variable-length flash attention where available, else
    SDPA per group over the cache columns already written."""
    dim, kv_heads = parts.spec.head_dim, parts.spec.num_kv_heads
    varlen = varlen_attention(prompt_mask.device, parts.weights.embed.dtype)
    if varlen is not None:  # causal attention per row of the packed batch: no groups, no dense queries, no mask
        cu_seq = F.pad(torch.cumsum(packed.row_lengths, 0, dtype=torch.int32), (1, 0))  # [N + 1]
        longest = max(packed.rows.real_counts)

        def attend(layer: int, q, k, v):
            # (v is a view of the fused q|k|v projection's output: strided rows)
            return varlen(q[:, :, 0], k[:, :, 0], v[:, :, 0].contiguous(), cu_seq, longest, dim ** -0.5).unsqueeze(2)
        return attend
    prompt_len = prompt_mask.shape[1]
    plans = [_group_plan(prompt_mask, packed, group, prompt_len) for group in groups]

    def attend(layer: int, q, k, v):
        return _attend_groups(q, key_cache[layer], value_cache[layer], groups, plans, prompt_len, kv_heads)
    return attend


def _group_plan(prompt_mask, packed: Packed, group: Group, prompt_len: int):
    """``(local index [T_g], packed slice, keep [rows, 1, L, L])`` of one group: where its packed tokens
    sit in its dense ``[rows * L]`` query block, and its causal mask over its columns."""
    first, stop, length = group
    start = prompt_len - length
    span = slice(packed.offsets[first], packed.offsets[stop])  # rows are contiguous in packed order
    local = (packed.row_of[span] - first) * length + (packed.col_of[span] - start)
    return local, span, masks.prefill_mask(prompt_mask[first:stop, start:])


def _attend_groups(q, key_layer, value_layer, groups: list[Group], plans, prompt_len: int, kv_heads: int):
    """SDPA per group: its queries scattered into ``[rows, Hq, L, D]`` against its cache columns
    (already written), gathered back to the packed ``[T, Hq, 1, D]``."""
    _, heads, _, dim = q.shape
    attn = torch.empty_like(q)
    for (first, stop, length), (local, span, keep) in zip(groups, plans):
        rows, start = stop - first, prompt_len - length
        dense = q.new_zeros((rows * length, heads, dim))
        dense.index_copy_(0, local, q[span, :, 0])
        out = F.scaled_dot_product_attention(
            dense.view(rows, length, heads, dim).transpose(1, 2), key_layer[first:stop, :, start:prompt_len],
            value_layer[first:stop, :, start:prompt_len], attn_mask=keep, scale=dim ** -0.5,
            enable_gqa=heads != kv_heads)  # [rows, Hq, L, D]
        attn[span, :, 0] = out.transpose(1, 2).reshape(rows * length, heads, dim).index_select(0, local)
    return attn


def attention_path(device: torch.device, dtype: torch.dtype) -> str:
    """``"varlen"`` where :func:`varlen_attention` is available for ``device``/``dtype``, else ``"packed"``
    (attention per group with SDPA): the packed prefill's entry of ``routes.PREFILL_PATHS``."""
    return "varlen" if varlen_attention(device, dtype) is not None else "packed"


@functools.lru_cache(maxsize=None)
def _varlen_kernel():
    """``(varlen_attn, causal keyword, accepts enable_gqa)`` of this torch, or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:  # torch >= 2.11
        causal = {"window_size": (-1, 0)}
    elif "is_causal" in params:  # torch 2.10
        causal = {"is_causal": True}
    else:
        return None
    return varlen_attn, causal, "enable_gqa" in params


def varlen_attention(device: torch.device, dtype: torch.dtype):
    """``attend(q [T, Hq, D], k [T, Hkv, D], v, cu_seq [N + 1] int32, max_len, scale) -> [T, Hq, D]``:
    causal attention within each row of a packed batch through flash attention's variable-length kernel
    (``torch.nn.attention.varlen``; CUDA, fp16/bf16), or None where it is unavailable (the caller then
    attends per group with SDPA). Query heads share KV heads natively where the kernel accepts GQA,
    else the KV heads are repeated."""
    kernel = _varlen_kernel()
    if kernel is None or torch.device(device).type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return None
    varlen_attn, causal, native_gqa = kernel

    def attend(q, k, v, cu_seq, max_len: int, scale: float):
        extra = dict(causal)
        if k.shape[1] != q.shape[1]:
            if native_gqa:
                extra["enable_gqa"] = True
            else:
                repeat = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        return varlen_attn(q, k, v, cu_seq, cu_seq, max_len, max_len, scale=scale, **extra)

    return attend

"""The nucleus (top-p) filter without a sort: the compiled sampler's path (:mod:`rollout.ops.sampling`).

HF's ``TopPLogitsWarper`` semantics (ascending stable order, cumulative softmax, drop where it is
``<= 1 - top_p``, keep the most likely token), found by a search over the scores' order-preserving
int32 bit patterns for the boundary score — each pass evaluates ``ARITY - 1`` thresholds in one fused
reduction — after which the straddling tie group loses its lowest-index members,
``floor((1 - top_p - mass strictly below) / p)`` of them, as a stable sort's cumulative sum does. Masses
are summed in another order than HF's running sum, so the two differ only where a running sum lies within
rounding (~1e-7) of ``1 - top_p``. No host sync, no data-dependent shape.
"""

from __future__ import annotations

import struct

import torch
import torch.nn.functional as F

ARITY = 16
"""Sub-intervals per search pass (``ARITY - 1`` thresholds evaluated by one fused reduction)."""
CHUNK = 128
"""Tokens per chunk when locating the first kept member of the straddling tie group."""


def ordered_keys(scores: torch.Tensor) -> torch.Tensor:
    """int32 keys that order like the fp32 ``scores`` (non-negative floats order like their bits; the
    magnitude bits of negative ones are flipped); -0.0 counts as +0.0, as a comparison sort sees it."""
    bits = torch.where(scores == 0, 0.0, scores).view(torch.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@torch.compiler.assume_constant_result
def _float32(value: float) -> float:  # a Python float rounded to fp32
    return struct.unpack("f", struct.pack("f", value))[0]


def _num_passes(size: int) -> int:  # search passes that narrow ``size`` candidates down to one
    passes = 0
    while size > 1:
        size, passes = -(-size // ARITY), passes + 1
    return passes


def _search_largest(evaluate, lo: torch.Tensor, hi: torch.Tensor, bound, at_lo: torch.Tensor, size: int):
    """Per row, the largest ``t`` in ``[lo, hi]`` (int64 ``[B]``, at most ``size`` values) with
    ``evaluate(t) <= bound``, and ``evaluate`` there, for a nondecreasing ``evaluate`` (thresholds
    ``[B, ARITY - 1]`` -> values of the same shape) with ``evaluate(lo) = at_lo <= bound``."""
    offsets = torch.arange(1, ARITY, device=lo.device)
    for _ in range(_num_passes(size)):
        step = (hi - lo) // ARITY + 1  # ceil((hi - lo + 1) / ARITY): every part holds <= step values
        thresholds = torch.minimum(lo[:, None] + offsets * step[:, None], hi[:, None])  # [B, ARITY - 1]
        values = evaluate(thresholds)
        num_ok = (values <= bound).sum(dim=-1)  # a prefix of the thresholds (evaluate is monotone)
        last_ok = (num_ok - 1).clamp(min=0)[:, None]
        first_bad = num_ok.clamp(max=ARITY - 2)[:, None]
        new_hi = torch.where(num_ok < ARITY - 1, thresholds.gather(1, first_bad)[:, 0] - 1, hi)
        at_lo = torch.where(num_ok > 0, values.gather(1, last_ok)[:, 0], at_lo)
        lo = torch.where(num_ok > 0, thresholds.gather(1, last_ok)[:, 0], lo)
        hi = new_hi
    return lo, at_lo


def _sums_below(values: torch.Tensor, keys: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    """``[B, K]``: per row, the sum of ``values`` where ``keys < thresholds[:, k]``; K reductions over
    the same inputs, which the compiler fuses into one pass over the row."""
    limits = thresholds.to(keys.dtype)
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    return torch.stack([torch.where(keys < limits[:, k, None], values, zero).sum(dim=-1)
                        for k in range(limits.shape[1])], dim=-1)


def _nth_member(group: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Per row, the vocabulary index of member ``n`` (0-based, in index order) of ``group [B, V]``:
    members counted per chunk, the chunk found by a search over the counts, the member by its rank
    inside that chunk (no scan over the vocabulary)."""
    num_rows, vocab = group.shape
    width = min(CHUNK, vocab)
    num_chunks = -(-vocab // width)
    counts = F.pad(group.to(torch.int32), (0, num_chunks * width - vocab)).view(num_rows, num_chunks, width).sum(-1)
    chunk_ids = torch.arange(num_chunks, device=group.device, dtype=torch.int32).expand(num_rows, num_chunks)
    lo, hi = torch.zeros_like(n), torch.full_like(n, num_chunks - 1)
    chunk, before = _search_largest(lambda t: _sums_below(counts, chunk_ids, t), lo, hi, n[:, None],
                                     torch.zeros_like(n), num_chunks)
    offsets = torch.arange(width, device=group.device)
    cols = chunk[:, None] * width + offsets  # [B, width]
    inside = group.gather(1, cols.clamp(max=vocab - 1)) & (cols < vocab)
    upto = offsets[None, :] <= offsets[:, None]  # upto[i, j]: j <= i
    rank = (inside[:, None, :] & upto).sum(dim=-1)  # [B, width]: members at or before each column
    return chunk * width + (rank <= (n - before)[:, None]).sum(dim=-1)


def top_p_keep(scores: torch.Tensor, top_p: float, key_shift: int = 0) -> torch.Tensor:
    """``keep [B, V]`` of HF's nucleus filter without sorting (see the module docstring).
    ``key_shift``: low key bits known to be zero in every score (16 for bf16 logits at temperature 1
    without penalty), which halves the passes."""
    tau = _float32(1.0 - top_p)  # HF compares its fp32 cumulative sums with this, rounded to fp32
    probs = scores.softmax(dim=-1)
    keys = ordered_keys(scores) >> key_shift
    top_key = (ordered_keys(scores.amax(dim=-1)) >> key_shift).long()
    lo = torch.full_like(top_key, -(2**31) >> key_shift)
    # boundary: the largest key whose strictly-lower mass is <= tau; everything above it is kept
    boundary, below = _search_largest(lambda t: _sums_below(probs, keys, t), lo, top_key, tau,
                                      torch.zeros_like(probs[:, 0]), 2 ** (32 - key_shift))
    boundary = boundary.to(keys.dtype)
    group = keys == boundary[:, None]  # the tie group straddling the boundary
    p_group = torch.where(group, probs, 0.0).amax(dim=-1)
    size = group.sum(dim=-1)
    removed = ((tau - below) / p_group).floor().clamp(min=0)
    removed = torch.minimum(removed, (size - 1).to(removed.dtype)).long()  # the top token always stays
    first_kept = _nth_member(group, removed)
    index = torch.arange(scores.shape[-1], device=scores.device)
    return (keys > boundary[:, None]) | (group & (index >= first_kept[:, None]))

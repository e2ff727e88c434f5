"""The Triton kernel of :mod:`rollout.ops.fused_nucleus` (imported only where it runs: this module imports
triton). One program per row; see ``fused_nucleus`` for the algorithm and its semantics."""

import triton
import triton.language as tl


@triton.jit
def hash32(x):  # uint32 in, uint32 out: sampling.hash32
    x = ((x >> 16) ^ x) * 0x45D9F3B
    x = ((x >> 16) ^ x) * 0x45D9F3B
    return (x >> 16) ^ x


@triton.jit
def logits_at(row_ptr, idx, vocab):  # the raw logits (fp32); -inf past the vocabulary
    return tl.load(row_ptr + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)


@triton.jit
def scaled(raw, temperature, SCALE: tl.constexpr):  # the scores sampled from: logits / T, as torch divides
    if SCALE:
        raw = tl.math.div_rn(raw, temperature)
    return raw


@triton.jit
def keys_of(s, SHIFT: tl.constexpr):  # nucleus.ordered_keys(s) >> SHIFT; -0.0 counts as +0.0
    bits = tl.where(s == 0.0, 0.0, s).to(tl.int32, bitcast=True)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)) >> SHIFT


@triton.jit
def thresholds_of(lo, hi, ARITY: tl.constexpr):  # [ARITY] int32: the search pass's keys, evenly over (lo, hi]
    lanes = tl.arange(0, ARITY)
    step = (hi - lo) // ARITY + 1
    return tl.minimum(lo + (lanes + 1).to(tl.int64) * step, hi).to(tl.int32)


@triton.jit
def narrowed(lo, hi, at_lo, thresholds, below, limit, ARITY: tl.constexpr):
    """``(lo, hi, at_lo)`` after a pass whose thresholds have ``below`` [ARITY] (nondecreasing) of mass under them:
    ``lo`` moves to the last threshold whose mass is ``<= limit`` (``at_lo`` to that mass), ``hi`` below the first
    that is not."""
    ok = below <= limit
    num_ok = tl.sum(ok.to(tl.int32), 0)
    last_ok_t = tl.max(tl.where(ok, thresholds, -(2 ** 31)), 0).to(tl.int64)
    last_ok_v = tl.max(tl.where(ok, below, 0.0), 0)
    first_bad_t = tl.min(tl.where(ok, 2 ** 31 - 1, thresholds), 0).to(tl.int64)
    return (tl.where(num_ok > 0, last_ok_t, lo), tl.where(num_ok < ARITY, first_bad_t - 1, hi),
            tl.where(num_ok > 0, last_ok_v, at_lo))


@triton.jit
def first_kept_rank(boundary, at_lo, limit, top, temperature, SCALE: tl.constexpr, SHIFT: tl.constexpr):
    """1-based rank (in index order) of the first kept member of the boundary key's tie group: members of lower
    rank carry the mass that is still ``<= limit`` above ``at_lo``."""
    bits = boundary << SHIFT
    bits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    group_mass = tl.exp(scaled(bits.to(tl.float32, bitcast=True), temperature, SCALE) - top)
    removed = tl.maximum(tl.floor((limit - at_lo) / group_mass), 0.0)
    return tl.minimum(removed, 2.0 ** 30).to(tl.int32) + 1


@triton.jit
def noise_base(seed_ptr, rows_ptr, step_ptr, step_stride, row):  # uint32: the row's key of the Gumbel noise
    sample = tl.load(rows_ptr + row).to(tl.uint32)
    token_step = tl.load(step_ptr + row * step_stride).to(tl.uint32)
    return hash32(hash32(tl.load(seed_ptr).to(tl.uint32) ^ (sample * 0x063779B1)) ^ (token_step * 0x05EBCA6B))


@triton.jit
def gumbel_update(idx, s, kept, base, lane_best, lane_idx, lane_score):
    """One block of Gumbel-max: each lane keeps its best ``s + Gumbel noise`` over kept tokens, its index and score
    (strictly better only: a lane keeps its first index among equal values)."""
    noise = hash32(base ^ (idx.to(tl.uint32) * 0x45D9F3B))
    # capped at 1 - 2**-24 (sampling.UNIFORM_MAX): the hash's top 128 values round to 1.0, whose noise is infinite
    uniform = tl.minimum((noise.to(tl.float32) + 0.5) * (1.0 / 4294967296.0), 0.999999940395355224609375)
    value = tl.where(kept, s - tl.log(-tl.log(uniform)), float("-inf"))
    better = value > lane_best
    return tl.where(better, value, lane_best), tl.where(better, idx, lane_idx), tl.where(better, s, lane_score)


@triton.jit
def lane_argmax(lane_best, lane_idx):  # (the best value, the first index holding it)
    best = tl.max(lane_best, 0)
    return best, tl.min(tl.where(lane_best == best, lane_idx, 2 ** 31 - 1), 0)


@triton.jit
def nucleus_sample(logits_ptr, row_stride, vocab, seed_ptr, rows_ptr, step_ptr, step_stride,
                   tokens_ptr, logprobs_ptr, temperature, tau,
                   SHIFT: tl.constexpr, SCALE: tl.constexpr, WITH_LOGPROBS: tl.constexpr,
                   ARITY: tl.constexpr, BLOCK: tl.constexpr):
    # Every pass keeps per-lane partial results in registers ([BLOCK] or [ARITY, BLOCK]) and reduces
    # across the program once, at its end: no cross-warp reduction inside the loops over the row.
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * row_stride
    offs = tl.arange(0, BLOCK)

    # 1. the row's largest score and smallest key
    # (keys are the raw logits' keys: dividing by T > 0 keeps their order and their ties, so the boundary
    #  found over them is the one over the scaled scores, and bf16 logits keep 16-bit keys at any T)
    lane_top = tl.full((BLOCK,), float("-inf"), tl.float32)
    lane_low = tl.full((BLOCK,), 2 ** 31 - 1, tl.int32)
    for start in range(0, vocab, BLOCK):
        idx = start + offs
        raw = logits_at(row_ptr, idx, vocab)
        lane_top = tl.maximum(lane_top, raw)
        lane_low = tl.minimum(lane_low, tl.where(idx < vocab, keys_of(raw, SHIFT), 2 ** 31 - 1))
    top_raw = tl.max(lane_top, 0)
    top = scaled(top_raw, temperature, SCALE)  # the largest score (division is monotone)

    # 2. boundary: the largest key t in [lo, hi] with sum_{key < t} exp(s - top) <= tau * Z, where
    #    Z = sum exp(s - top) (summed along, in the same order, on the first pass)
    lo = tl.min(lane_low, 0).to(tl.int64)  # nothing lies below the smallest key
    hi = keys_of(top_raw, SHIFT).to(tl.int64)
    at_lo = tl.zeros((), tl.float32)
    limit = tl.zeros((), tl.float32)
    passes = tl.zeros((), tl.int32)
    while lo < hi:
        thresholds = thresholds_of(lo, hi, ARITY)
        lane_below = tl.zeros((ARITY, BLOCK), tl.float32)
        lane_total = tl.zeros((BLOCK,), tl.float32)
        for start in range(0, vocab, BLOCK):
            raw = logits_at(row_ptr, start + offs, vocab)
            keys = keys_of(raw, SHIFT)
            mass = tl.exp(scaled(raw, temperature, SCALE) - top)
            lane_below += tl.where(keys[None, :] < thresholds[:, None], mass[None, :], 0.0)
            lane_total += mass
        limit = tl.where(passes == 0, tau * tl.sum(lane_total, 0), limit)
        passes += 1
        lo, hi, at_lo = narrowed(lo, hi, at_lo, thresholds, tl.sum(lane_below, 1), limit, ARITY)
    boundary = lo.to(tl.int32)
    if passes == 0:  # one key in the row (one token, or all scores equal): Z without a search
        lane_total = tl.zeros((BLOCK,), tl.float32)
        for start in range(0, vocab, BLOCK):
            lane_total += tl.exp(scaled(logits_at(row_ptr, start + offs, vocab), temperature, SCALE) - top)
        limit = tau * tl.sum(lane_total, 0)

    # 3. the tie group at the boundary: members of rank <= removed (1-based) are dropped
    target = first_kept_rank(boundary, at_lo, limit, top, temperature, SCALE, SHIFT)
    seen = tl.zeros((), tl.int32)
    first_kept = tl.full((), 2 ** 31 - 1, tl.int32)
    lane_last = tl.full((BLOCK,), -1, tl.int32)
    for start in range(0, vocab, BLOCK):
        idx = start + offs
        member = keys_of(logits_at(row_ptr, idx, vocab), SHIFT) == boundary
        lane_last = tl.maximum(lane_last, tl.where(member, idx, -1))
        count = tl.sum(member.to(tl.int32), 0)
        if (seen < target) & (target <= seen + count):  # the one block holding it: rank its members
            rank = seen + tl.cumsum(member.to(tl.int32), 0)
            first_kept = tl.min(tl.where(member & (rank == target), idx, 2 ** 31 - 1), 0)
        seen += count
    first_kept = tl.minimum(first_kept, tl.max(lane_last, 0))  # the most likely token always stays

    # 4. Gumbel-max over the kept tokens; the kept mass for the log-probability
    base = noise_base(seed_ptr, rows_ptr, step_ptr, step_stride, row)
    lane_best = tl.full((BLOCK,), float("-inf"), tl.float32)
    lane_idx = tl.full((BLOCK,), 2 ** 31 - 1, tl.int32)
    lane_score = tl.zeros((BLOCK,), tl.float32)
    lane_kept = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, vocab, BLOCK):
        idx = start + offs
        raw = logits_at(row_ptr, idx, vocab)
        s = scaled(raw, temperature, SCALE)
        keys = keys_of(raw, SHIFT)
        kept = (keys > boundary) | ((keys == boundary) & (idx >= first_kept))
        lane_best, lane_idx, lane_score = gumbel_update(idx, s, kept, base, lane_best, lane_idx, lane_score)
        if WITH_LOGPROBS:
            lane_kept += tl.where(kept, tl.exp(s - top), 0.0)
    _, best_idx = lane_argmax(lane_best, lane_idx)
    tl.store(tokens_ptr + row, best_idx.to(tl.int64))
    if WITH_LOGPROBS:
        best_score = tl.max(tl.where(lane_idx == best_idx, lane_score, float("-inf")), 0)
        tl.store(logprobs_ptr + row, (best_score - top) - tl.log(tl.sum(lane_kept, 0)))

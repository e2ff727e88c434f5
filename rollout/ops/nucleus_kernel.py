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
def scores_at(row_ptr, idx, vocab, temperature, SCALE: tl.constexpr):
    s = tl.load(row_ptr + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
    if SCALE:
        s = tl.math.div_rn(s, temperature)
    return s

@triton.jit
def keys_of(s, SHIFT: tl.constexpr):  # nucleus.ordered_keys(s) >> SHIFT; -0.0 counts as +0.0
    bits = tl.where(s == 0.0, 0.0, s).to(tl.int32, bitcast=True)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)) >> SHIFT

@triton.jit
def nucleus_sample(logits_ptr, row_stride, vocab, seed_ptr, rows_ptr, step_ptr, step_stride,
                   tokens_ptr, logprobs_ptr, temperature, tau,
                   SHIFT: tl.constexpr, PASSES: tl.constexpr, SCALE: tl.constexpr,
                   WITH_LOGPROBS: tl.constexpr, ARITY: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * row_stride
    offs = tl.arange(0, BLOCK)

    # 1. max and Z = sum exp(s - max), online
    top = tl.full((), float("-inf"), tl.float32)
    total = tl.zeros((), tl.float32)
    for start in range(0, vocab, BLOCK):
        s = scores_at(row_ptr, start + offs, vocab, temperature, SCALE)
        new_top = tl.maximum(top, tl.max(s, 0))
        total = total * tl.exp(top - new_top) + tl.sum(tl.exp(s - new_top), 0)
        top = new_top
    limit = tau * total  # masses below are compared unnormalised: sum exp(s - top) <= tau * Z

    # 2. boundary: the largest key t in [lo, hi] with sum_{key < t} exp(s - top) <= limit
    lo = tl.full((), -(2 ** 31), tl.int64) >> SHIFT
    hi = keys_of(top, SHIFT).to(tl.int64)
    at_lo = tl.zeros((), tl.float32)
    lanes = tl.arange(0, ARITY)
    for _ in range(PASSES):
        step = (hi - lo) // ARITY + 1
        thresholds = tl.minimum(lo + (lanes + 1).to(tl.int64) * step, hi).to(tl.int32)  # [ARITY]
        below = tl.zeros((ARITY,), tl.float32)
        for start in range(0, vocab, BLOCK):
            s = scores_at(row_ptr, start + offs, vocab, temperature, SCALE)
            keys = keys_of(s, SHIFT)
            mass = tl.exp(s - top)
            below += tl.sum(tl.where(keys[None, :] < thresholds[:, None], mass[None, :], 0.0), 1)
        ok = below <= limit  # a prefix of the lanes (mass below is nondecreasing in t)
        num_ok = tl.sum(ok.to(tl.int32), 0)
        last_ok_t = tl.max(tl.where(ok, thresholds, -(2 ** 31)), 0).to(tl.int64)
        last_ok_v = tl.max(tl.where(ok, below, 0.0), 0)
        first_bad_t = tl.min(tl.where(ok, 2 ** 31 - 1, thresholds), 0).to(tl.int64)
        hi = tl.where(num_ok < ARITY, first_bad_t - 1, hi)
        at_lo = tl.where(num_ok > 0, last_ok_v, at_lo)
        lo = tl.where(num_ok > 0, last_ok_t, lo)
    boundary = lo.to(tl.int32)

    # 3. the tie group at the boundary: its members of rank < removed are dropped
    bits = (boundary << SHIFT)
    bits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    group_mass = tl.exp(bits.to(tl.float32, bitcast=True) - top)
    removed = tl.maximum(tl.floor((limit - at_lo) / group_mass), 0.0)
    removed = tl.minimum(removed, 2.0 ** 30).to(tl.int32)
    seen = tl.zeros((), tl.int32)
    first_kept = tl.full((), 2 ** 31 - 1, tl.int32)
    last_member = tl.full((), -1, tl.int32)
    for start in range(0, vocab, BLOCK):
        idx = start + offs
        member = keys_of(scores_at(row_ptr, idx, vocab, temperature, SCALE), SHIFT) == boundary
        rank = seen + tl.cumsum(member.to(tl.int32), 0)  # 1-based rank of each member
        first_kept = tl.minimum(first_kept, tl.min(tl.where(member & (rank == removed + 1), idx, 2 ** 31 - 1), 0))
        last_member = tl.maximum(last_member, tl.max(tl.where(member, idx, -1), 0))
        seen += tl.sum(member.to(tl.int32), 0)
    first_kept = tl.minimum(first_kept, last_member)  # the most likely token always stays

    # 4. Gumbel-max over the kept tokens; the kept mass for the log-probability
    sample = tl.load(rows_ptr + row).to(tl.uint32)
    token_step = tl.load(step_ptr + row * step_stride).to(tl.uint32)
    base = hash32(hash32(tl.load(seed_ptr).to(tl.uint32) ^ (sample * 0x063779B1)) ^ (token_step * 0x05EBCA6B))
    best = tl.full((), float("-inf"), tl.float32)
    best_idx = tl.zeros((), tl.int32)
    best_score = tl.zeros((), tl.float32)
    kept_mass = tl.zeros((), tl.float32)
    for start in range(0, vocab, BLOCK):
        idx = start + offs
        s = scores_at(row_ptr, idx, vocab, temperature, SCALE)
        keys = keys_of(s, SHIFT)
        kept = (keys > boundary) | ((keys == boundary) & (idx >= first_kept))
        noise = hash32(base ^ (idx.to(tl.uint32) * 0x45D9F3B))
        uniform = (noise.to(tl.float32) + 0.5) * (1.0 / 4294967296.0)
        value = tl.where(kept, s - tl.log(-tl.log(uniform)), float("-inf"))
        block_best = tl.max(value, 0)
        block_idx = tl.min(tl.where(value == block_best, idx, 2 ** 31 - 1), 0)  # first of equals
        better = block_best > best
        best_score = tl.where(better, tl.max(tl.where(idx == block_idx, s, float("-inf")), 0), best_score)
        best_idx = tl.where(better, block_idx, best_idx)
        best = tl.maximum(best, block_best)
        if WITH_LOGPROBS:
            kept_mass += tl.sum(tl.where(kept, tl.exp(s - top), 0.0), 0)
    tl.store(tokens_ptr + row, best_idx.to(tl.int64))
    if WITH_LOGPROBS:
        tl.store(logprobs_ptr + row, (best_score - top) - tl.log(kept_mass))

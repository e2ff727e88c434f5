"""The Triton kernels of :func:`rollout.ops.fused_nucleus.sample_top_p` with each row cut into chunks (imported only
where they run: this module imports triton). Same algorithm and semantics as the one-program kernel of
:mod:`rollout.ops.nucleus_kernel` (see ``fused_nucleus``), spread over up to ``rows x chunks`` programs (a program
takes ``per_program`` consecutive chunks, each summed and stored on its own, so how many programs a row gets changes
no result) and a launch per pass over the row:

- ``chunk_stats``: each chunk's largest raw logit and smallest key;
- ``search_pass`` (``passes`` launches, the number a key of this width needs at this arity): each chunk's masses
  below the pass's thresholds (and, in the first pass, its part of ``Z``);
- ``tie_members``: each chunk's count of tokens whose key is the boundary;
- ``draw``: each chunk's Gumbel-max over its kept tokens (and its kept mass);
- ``finish``: per row, the best of its chunks, and the log-probability.

No program waits for another: every program of a pass replays the search from the stored partial sums of the
earlier passes (a few hundred floats), so all programs of a row hold the same state, and the sums are taken in one
fixed order (lanes of a chunk, then chunks in order), whatever the number of rows.
"""

import triton
import triton.language as tl

from rollout.ops.nucleus_kernel import (first_kept_rank, gumbel_update, keys_of, lane_argmax, logits_at, narrowed,
                                        noise_base, scaled, thresholds_of)


@triton.jit
def chunk_stats(logits_ptr, row_stride, vocab, span, top_ptr, low_ptr, chunks, per_program,
                SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    row, group = tl.program_id(0), tl.program_id(1)
    row_ptr = logits_ptr + row.to(tl.int64) * row_stride
    offs = tl.arange(0, BLOCK)
    for chunk in range(group * per_program, tl.minimum((group + 1) * per_program, chunks)):
        begin = chunk * span
        end = tl.minimum(begin + span, vocab)
        lane_top = tl.full((BLOCK,), float("-inf"), tl.float32)
        lane_low = tl.full((BLOCK,), 2 ** 31 - 1, tl.int32)
        for start in range(begin, end, BLOCK):
            idx = start + offs
            raw = logits_at(row_ptr, idx, end)
            lane_top = tl.maximum(lane_top, raw)
            lane_low = tl.minimum(lane_low, tl.where(idx < end, keys_of(raw, SHIFT), 2 ** 31 - 1))
        tl.store(top_ptr + row * chunks + chunk, tl.max(lane_top, 0))
        tl.store(low_ptr + row * chunks + chunk, tl.min(lane_low, 0))


@triton.jit
def row_top(top_ptr, row, chunks, CHUNKS: tl.constexpr):  # the row's largest raw logit
    cs = tl.arange(0, CHUNKS)
    return tl.max(tl.load(top_ptr + row * chunks + cs, mask=cs < chunks, other=float("-inf")), 0)


@triton.jit
def search_state(top_ptr, low_ptr, below_ptr, total_ptr, row, rows, chunks, done, tau,
                 SHIFT: tl.constexpr, ARITY: tl.constexpr, CHUNKS: tl.constexpr):
    """``(lo, hi, at_lo, limit)`` after the first ``done`` passes: the one-program kernel's updates, replayed from
    their stored partial sums (summed over the chunks in order)."""
    cs = tl.arange(0, CHUNKS)
    in_row = cs < chunks
    lo = tl.min(tl.load(low_ptr + row * chunks + cs, mask=in_row, other=2 ** 31 - 1), 0).to(tl.int64)
    hi = keys_of(row_top(top_ptr, row, chunks, CHUNKS), SHIFT).to(tl.int64)
    limit = tau * tl.sum(  # Z: stored by the first pass (none yet in it)
        tl.load(total_ptr + row * chunks + cs, mask=cs < chunks * tl.minimum(done, 1), other=0.0), 0)
    at_lo = tl.zeros((), tl.float32)
    lanes = tl.arange(0, ARITY)
    for p in range(0, done):
        searching = lo < hi  # a pass that found the row done left no partial sums
        base = below_ptr + ((p * rows + row) * chunks) * ARITY
        part = tl.load(base + cs[:, None] * ARITY + lanes[None, :], mask=cs[:, None] < chunks * searching.to(tl.int32),
                       other=0.0)
        new_lo, new_hi, new_at_lo = narrowed(lo, hi, at_lo, thresholds_of(lo, hi, ARITY), tl.sum(part, 0), limit,
                                             ARITY)
        lo, hi, at_lo = (tl.where(searching, new_lo, lo), tl.where(searching, new_hi, hi),
                         tl.where(searching, new_at_lo, at_lo))
    return lo, hi, at_lo, limit


@triton.jit
def search_pass(logits_ptr, row_stride, vocab, span, top_ptr, low_ptr, below_ptr, total_ptr, rows, chunks,
                per_program, done, temperature, tau,
                SHIFT: tl.constexpr, SCALE: tl.constexpr, ARITY: tl.constexpr, BLOCK: tl.constexpr,
                CHUNKS: tl.constexpr):
    """Pass ``done`` (0-based): the chunk's masses below each of the pass's ``ARITY`` thresholds; the first pass
    also stores the chunk's part of ``Z`` (and runs even where the row has one key, for ``Z``)."""
    row, group = tl.program_id(0), tl.program_id(1)
    lo, hi, at_lo, limit = search_state(top_ptr, low_ptr, below_ptr, total_ptr, row, rows, chunks, done, tau,
                                        SHIFT, ARITY, CHUNKS)
    if (done == 0) | (lo < hi):
        top = scaled(row_top(top_ptr, row, chunks, CHUNKS), temperature, SCALE)
        row_ptr = logits_ptr + row.to(tl.int64) * row_stride
        offs = tl.arange(0, BLOCK)
        lanes = tl.arange(0, ARITY)
        thresholds = thresholds_of(lo, hi, ARITY)
        for chunk in range(group * per_program, tl.minimum((group + 1) * per_program, chunks)):
            begin = chunk * span
            end = tl.minimum(begin + span, vocab)
            lane_below = tl.zeros((ARITY, BLOCK), tl.float32)
            lane_total = tl.zeros((BLOCK,), tl.float32)
            for start in range(begin, end, BLOCK):
                raw = logits_at(row_ptr, start + offs, end)
                keys = keys_of(raw, SHIFT)
                mass = tl.exp(scaled(raw, temperature, SCALE) - top)
                lane_below += tl.where(keys[None, :] < thresholds[:, None], mass[None, :], 0.0)
                lane_total += mass
            tl.store(below_ptr + ((done * rows + row) * chunks + chunk) * ARITY + lanes, tl.sum(lane_below, 1))
            if done == 0:
                tl.store(total_ptr + row * chunks + chunk, tl.sum(lane_total, 0))


@triton.jit
def tie_members(logits_ptr, row_stride, vocab, span, top_ptr, low_ptr, below_ptr, total_ptr, count_ptr, rows,
                chunks, per_program, passes, tau,
                SHIFT: tl.constexpr, ARITY: tl.constexpr, BLOCK: tl.constexpr, CHUNKS: tl.constexpr):
    """How many of the chunk's tokens have the boundary key."""
    row, group = tl.program_id(0), tl.program_id(1)
    boundary, _, _, _ = search_state(top_ptr, low_ptr, below_ptr, total_ptr, row, rows, chunks, passes, tau,
                                     SHIFT, ARITY, CHUNKS)
    boundary = boundary.to(tl.int32)
    row_ptr = logits_ptr + row.to(tl.int64) * row_stride
    offs = tl.arange(0, BLOCK)
    for chunk in range(group * per_program, tl.minimum((group + 1) * per_program, chunks)):
        begin = chunk * span
        end = tl.minimum(begin + span, vocab)
        lane_count = tl.zeros((BLOCK,), tl.int32)
        for start in range(begin, end, BLOCK):
            idx = start + offs
            member = (keys_of(logits_at(row_ptr, idx, end), SHIFT) == boundary) & (idx < end)
            lane_count += member.to(tl.int32)
        tl.store(count_ptr + row * chunks + chunk, tl.sum(lane_count, 0))


@triton.jit
def draw_lanes(BLOCK: tl.constexpr):
    """A chunk's per-lane Gumbel-max state before its first block: best value, its index, its score, kept mass."""
    return (tl.full((BLOCK,), float("-inf"), tl.float32), tl.full((BLOCK,), 2 ** 31 - 1, tl.int32),
            tl.zeros((BLOCK,), tl.float32), tl.zeros((BLOCK,), tl.float32))


@triton.jit
def store_draw(best_ptr, index_ptr, score_ptr, kept_ptr, at, lane_best, lane_idx, lane_score, lane_kept,
               WITH_LOGPROBS: tl.constexpr):
    """A chunk's draw, reduced over its lanes, at cell ``at``: the best value and its first index; with
    log-probabilities the best token's score and the chunk's kept mass."""
    best, best_idx = lane_argmax(lane_best, lane_idx)
    tl.store(best_ptr + at, best)
    tl.store(index_ptr + at, best_idx)
    if WITH_LOGPROBS:
        tl.store(score_ptr + at, tl.max(tl.where(lane_idx == best_idx, lane_score, float("-inf")), 0))
        tl.store(kept_ptr + at, tl.sum(lane_kept, 0))


@triton.jit
def draw(logits_ptr, row_stride, vocab, span, top_ptr, low_ptr, below_ptr, total_ptr, count_ptr,
         seed_ptr, rows_ptr, step_ptr, step_stride, best_ptr, index_ptr, score_ptr, kept_ptr,
         rows, chunks, per_program, passes, temperature, tau,
         SHIFT: tl.constexpr, SCALE: tl.constexpr, WITH_LOGPROBS: tl.constexpr, ARITY: tl.constexpr,
         BLOCK: tl.constexpr, CHUNKS: tl.constexpr):
    """Gumbel-max over the chunk's kept tokens: those above the boundary key, and the members of the boundary's tie
    group from the first kept rank on (ranks counted over the whole row, in index order)."""
    row, group = tl.program_id(0), tl.program_id(1)
    lo, _, at_lo, limit = search_state(top_ptr, low_ptr, below_ptr, total_ptr, row, rows, chunks, passes, tau,
                                       SHIFT, ARITY, CHUNKS)
    boundary = lo.to(tl.int32)
    top = scaled(row_top(top_ptr, row, chunks, CHUNKS), temperature, SCALE)

    # the tie group: members of rank < keep_from (1-based, over the row) are dropped; the last always stays
    target = first_kept_rank(boundary, at_lo, limit, top, temperature, SCALE, SHIFT)
    cs = tl.arange(0, CHUNKS)
    counts = tl.load(count_ptr + row * chunks + cs, mask=cs < chunks, other=0)
    through = tl.cumsum(counts, 0)  # members in chunks 0..c
    keep_from = tl.minimum(target, tl.sum(counts, 0))
    holder = tl.min(tl.where((through >= keep_from) & (cs < chunks), cs, CHUNKS), 0)  # the chunk holding that rank
    local_from = keep_from - tl.sum(tl.where(cs < holder, counts, 0), 0)  # the rank within the holder, 1-based

    base = noise_base(seed_ptr, rows_ptr, step_ptr, step_stride, row)
    row_ptr = logits_ptr + row.to(tl.int64) * row_stride
    offs = tl.arange(0, BLOCK)
    for chunk in range(group * per_program, tl.minimum((group + 1) * per_program, chunks)):
        begin = chunk * span
        end = tl.minimum(begin + span, vocab)
        seen = tl.zeros((), tl.int32)
        lane_best, lane_idx, lane_score, lane_kept = draw_lanes(BLOCK)
        for start in range(begin, end, BLOCK):
            idx = start + offs
            raw = logits_at(row_ptr, idx, end)
            s = scaled(raw, temperature, SCALE)
            keys = keys_of(raw, SHIFT)
            member = (keys == boundary) & (idx < end)
            if chunk == holder:
                tie_kept = member & (seen + tl.cumsum(member.to(tl.int32), 0) >= local_from)
                seen += tl.sum(member.to(tl.int32), 0)
            else:
                tie_kept = member & (chunk > holder)
            kept = (keys > boundary) | tie_kept
            lane_best, lane_idx, lane_score = gumbel_update(idx, s, kept, base, lane_best, lane_idx, lane_score)
            if WITH_LOGPROBS:
                lane_kept += tl.where(kept, tl.exp(s - top), 0.0)
        store_draw(best_ptr, index_ptr, score_ptr, kept_ptr, row * chunks + chunk, lane_best, lane_idx, lane_score,
                   lane_kept, WITH_LOGPROBS)


@triton.jit
def finish(top_ptr, best_ptr, index_ptr, score_ptr, kept_ptr, tokens_ptr, logprobs_ptr, chunks, temperature,
           SCALE: tl.constexpr, WITH_LOGPROBS: tl.constexpr, CHUNKS: tl.constexpr):
    """The row's token: its chunks' best value, the first index among equal ones; and its log-probability."""
    row = tl.program_id(0)
    cs = tl.arange(0, CHUNKS)
    in_row = cs < chunks
    best = tl.load(best_ptr + row * chunks + cs, mask=in_row, other=float("-inf"))
    index = tl.load(index_ptr + row * chunks + cs, mask=in_row, other=2 ** 31 - 1)
    _, token = lane_argmax(best, index)
    tl.store(tokens_ptr + row, token.to(tl.int64))
    if WITH_LOGPROBS:
        score = tl.max(tl.where(in_row & (index == token),
                                tl.load(score_ptr + row * chunks + cs, mask=in_row, other=float("-inf")),
                                float("-inf")), 0)
        kept = tl.sum(tl.load(kept_ptr + row * chunks + cs, mask=in_row, other=0.0), 0)
        top = scaled(row_top(top_ptr, row, chunks, CHUNKS), temperature, SCALE)
        tl.store(logprobs_ptr + row, (score - top) - tl.log(kept))


@triton.jit
def draw_all(logits_ptr, row_stride, vocab, span, top_ptr, seed_ptr, rows_ptr, step_ptr, step_stride, best_ptr,
             index_ptr, score_ptr, kept_ptr, chunks, per_program, temperature,
             SCALE: tl.constexpr, WITH_LOGPROBS: tl.constexpr, BLOCK: tl.constexpr, CHUNKS: tl.constexpr):
    """Plain sampling (top-p 1): :func:`draw` with every token kept, so no search ran before it; ``top_ptr`` (each
    chunk's largest raw logit, from :func:`chunk_stats`) is read only for the log-probability's mass."""
    row, group = tl.program_id(0), tl.program_id(1)
    if WITH_LOGPROBS:
        top = scaled(row_top(top_ptr, row, chunks, CHUNKS), temperature, SCALE)
    base = noise_base(seed_ptr, rows_ptr, step_ptr, step_stride, row)
    row_ptr = logits_ptr + row.to(tl.int64) * row_stride
    offs = tl.arange(0, BLOCK)
    for chunk in range(group * per_program, tl.minimum((group + 1) * per_program, chunks)):
        begin = chunk * span
        end = tl.minimum(begin + span, vocab)
        lane_best, lane_idx, lane_score, lane_kept = draw_lanes(BLOCK)
        for start in range(begin, end, BLOCK):
            idx = start + offs
            s = scaled(logits_at(row_ptr, idx, end), temperature, SCALE)
            kept = idx < end
            lane_best, lane_idx, lane_score = gumbel_update(idx, s, kept, base, lane_best, lane_idx, lane_score)
            if WITH_LOGPROBS:
                lane_kept += tl.where(kept, tl.exp(s - top), 0.0)
        store_draw(best_ptr, index_ptr, score_ptr, kept_ptr, row * chunks + chunk, lane_best, lane_idx, lane_score,
                   lane_kept, WITH_LOGPROBS)

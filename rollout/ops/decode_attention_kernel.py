"""The Triton kernels of :mod:`rollout.ops.decode_attention` (imported only where they run: this module
imports triton). Split-length ("flash-decoding") attention of one query per row, grouped by KV head, and
the shared-prefix pass that reads a prompt's keys and values once for all of its samples."""

import triton
import triton.language as tl


@triton.jit
def _first_kept(keep_row, keep_sl, length, SCAN: tl.constexpr, BLOCK_L: tl.constexpr):
    # The row's window starts at its first kept column (rounded down to a tile): the tiles of left padding
    # before it are never read. The scan reads SCAN columns of the mask at a time and stops at the first block
    # with a kept column (one load for most rows): a scan tile by tile costs a dependent load per tile, ~20 us
    # over 1k columns.
    scan = tl.arange(0, SCAN)
    first = length
    start = 0
    while (first == length) & (start < length):
        cols = start + scan
        kept = tl.load(keep_row + cols * keep_sl, mask=cols < length, other=0) != 0
        first = tl.minimum(first, tl.min(tl.where(kept, cols, length), 0))
        start += SCAN
    return (first // BLOCK_L) * BLOCK_L


@triton.jit
def _window(q, k_base, v_base, keep_row, k_sl, v_sl, keep_sl, lo, hi, d, d_ok, scale,
            ROWS: tl.constexpr, DIM_PAD: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_L: tl.constexpr,
            PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    # An online softmax of the ROWS queries q over columns [lo, hi) of one row's keys and values, in
    # BLOCK_L-column tiles (fp32 scores, probabilities cast to the values' dtype for the second product, as
    # SDPA's flash kernels do): the unnormalised sum, the running maximum and the softmax denominator.
    # DOT_FP32: both products on fp32 operands (only for triton's CPU interpreter, whose bf16 dot is wrong).
    cols0 = tl.arange(0, BLOCK_L)
    top = tl.full((ROWS,), float("-inf"), tl.float32)
    total = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, DIM_PAD), tl.float32)
    for start in range(lo, hi, BLOCK_L):
        cols = start + cols0
        c_ok = cols < hi
        keep = tl.load(keep_row + cols * keep_sl, mask=c_ok, other=0) != 0
        if EVEN_D:  # only whole rows masked: the loads stay vectorised
            k = tl.load(k_base + cols[:, None] * k_sl + d[None, :], mask=c_ok[:, None], other=0.0)
        else:
            k = tl.load(k_base + cols[:, None] * k_sl + d[None, :], mask=c_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_FP32:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision=PRECISION) * scale
        else:
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [ROWS, BLOCK_L] fp32
        s = tl.where(keep[None, :], s, float("-inf"))
        new_top = tl.maximum(top, tl.max(s, 1))
        safe_top = tl.where(new_top == float("-inf"), 0.0, new_top)  # a tile with nothing kept yet
        alpha = tl.exp(top - safe_top)
        p = tl.exp(s - safe_top[:, None])
        total = total * alpha + tl.sum(p, 1)
        if EVEN_D:
            v = tl.load(v_base + cols[:, None] * v_sl + d[None, :], mask=c_ok[:, None], other=0.0)
        else:
            v = tl.load(v_base + cols[:, None] * v_sl + d[None, :], mask=c_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_FP32:
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision=PRECISION)
        else:
            pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        acc = acc * alpha[:, None] + pv
        top = new_top
    return acc, top, total


@triton.jit
def decode_attention_split(q_ptr, k_ptr, v_ptr, keep_ptr, out_ptr, part_ptr, stat_ptr, from_ptr, last_ptr,
                           q_sb, q_sh, k_sb, k_sh, k_sl, v_sb, v_sh, v_sl, keep_sb, keep_sl,
                           o_sb, o_sh, length, splits, slot0, slots, scale,
                           GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM: tl.constexpr,
                           DIM_PAD: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_L: tl.constexpr, SCAN: tl.constexpr,
                           SINGLE: tl.constexpr, FROM: tl.constexpr, LAST: tl.constexpr, FOLD: tl.constexpr,
                           PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    # One program: row b, KV head kv, one share (split) of the row's key window.
    # The GROUP query heads that share KV head kv are the rows of one tile, so each key and value is read
    # once per KV head. The window: from the row's first kept column (FROM: from column *from_ptr, the end of a
    # shared prefix that decode_attention_prefix has covered) to the end (LAST: to column *last_ptr, inclusive:
    # the columns after it are masked for every row, so they are not read). What is left is shared among the
    # splits in whole tiles.
    b = tl.program_id(0).to(tl.int64)
    kv = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    g_ok = g < GROUP
    d_ok = d < DIM
    heads = kv * GROUP + g
    q = tl.load(q_ptr + b * q_sb + heads[:, None] * q_sh + d[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    keep_row = keep_ptr + b * keep_sb
    if FROM:
        first = tl.load(from_ptr).to(tl.int32)
    else:
        first = _first_kept(keep_row, keep_sl, length, SCAN, BLOCK_L)
    stop = length
    if LAST:
        stop = tl.minimum(stop, tl.load(last_ptr).to(tl.int32) + 1)
    tiles = tl.cdiv(tl.maximum(stop - first, 0), BLOCK_L)
    chunk = tl.cdiv(tiles, splits) * BLOCK_L
    lo = first + split * chunk
    hi = tl.minimum(lo + chunk, stop)
    acc, top, total = _window(q, k_ptr + b * k_sb + kv * k_sh, v_ptr + b * v_sb + kv * v_sh, keep_row, k_sl, v_sl,
                              keep_sl, lo, hi, d, d_ok, scale, GROUP_PAD, DIM_PAD, EVEN_D, BLOCK_L, PRECISION, DOT_FP32)
    slot = (b * (tl.num_programs(1) * GROUP) + heads) * slots
    if FOLD:  # one split after a prefix pass: fold in its partials (slots [0, slot0)) and normalise here
        for s in range(0, slot0):
            part_top = tl.load(stat_ptr + (slot + s) * 2, mask=g_ok, other=float("-inf"))
            part_total = tl.load(stat_ptr + (slot + s) * 2 + 1, mask=g_ok, other=0.0)
            part = tl.load(part_ptr + (slot + s)[:, None] * DIM_PAD + d[None, :], mask=g_ok[:, None], other=0.0)
            new_top = tl.maximum(top, part_top)
            safe_top = tl.where(new_top == float("-inf"), 0.0, new_top)
            alpha = tl.where(top == float("-inf"), 0.0, tl.exp(top - safe_top))
            beta = tl.where(part_top == float("-inf"), 0.0, tl.exp(part_top - safe_top))
            acc = acc * alpha[:, None] + part * beta[:, None]
            total = total * alpha + part_total * beta
            top = new_top
    if SINGLE or FOLD:  # normalise here; a row with nothing kept gets zeros
        out = acc / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(out_ptr + b * o_sb + heads[:, None] * o_sh + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=g_ok[:, None] & d_ok[None, :])
    else:  # partials [B, Hq, slots, DIM_PAD] and (top, total) [B, Hq, slots, 2], combined by decode_attention_merge
        slot = slot + slot0 + split
        tl.store(part_ptr + slot[:, None] * DIM_PAD + d[None, :], acc, mask=g_ok[:, None])
        tl.store(stat_ptr + slot * 2, top, mask=g_ok)
        tl.store(stat_ptr + slot * 2 + 1, total, mask=g_ok)


@triton.jit
def decode_attention_prefix(q_ptr, k_ptr, v_ptr, keep_ptr, ids_ptr, end_ptr, part_ptr, stat_ptr,
                            q_sb, q_sh, k_sb, k_sh, k_sl, v_sb, v_sh, v_sl, keep_sb, keep_sl,
                            rows, length, splits, slots, scale,
                            SAMPLES: tl.constexpr, GROUP: tl.constexpr, M_PAD: tl.constexpr, DIM: tl.constexpr,
                            DIM_PAD: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_L: tl.constexpr, SCAN: tl.constexpr,
                            PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    # The shared prompt of a run of rows: rows whose sample ids (ids_ptr) share id // SAMPLES hold copies of
    # the same prompt's keys and values in columns [0, *end_ptr). One program: the first row b of such a run
    # (the leader), KV head kv, one split of the prefix window. Its tile holds the queries of every row of
    # the run (at most SAMPLES rows) times the GROUP query heads of kv, so the prefix is read once for the
    # run instead of once per row. Partials go to slots [0, splits) of each of the run's rows; the programs
    # of rows that do not lead a run store nothing.
    b = tl.program_id(0).to(tl.int64)
    kv = tl.program_id(1)
    split = tl.program_id(2)
    key = tl.load(ids_ptr + b) // SAMPLES
    prev = tl.load(ids_ptr + tl.maximum(b - 1, 0)) // SAMPLES
    leader = (b == 0) | (prev != key)
    run = 1  # the run: rows b, b + 1, ... while their prompt is b's
    for j in tl.static_range(1, SAMPLES):
        inside = b + j < rows
        other = tl.load(ids_ptr + b + j, mask=inside, other=0) // SAMPLES
        run = tl.where(inside & (other == key) & (run == j), j + 1, run)
    m = tl.arange(0, M_PAD)
    member = m // GROUP
    heads = kv * GROUP + m % GROUP
    row = b + member
    m_ok = member < tl.where(leader, run, 0)  # no rows unless b leads its run
    d = tl.arange(0, DIM_PAD)
    d_ok = d < DIM
    q = tl.load(q_ptr + row[:, None] * q_sb + heads[:, None] * q_sh + d[None, :], mask=m_ok[:, None] & d_ok[None, :],
                other=0.0)
    keep_row = keep_ptr + b * keep_sb
    stop = tl.load(end_ptr).to(tl.int32)
    first = _first_kept(keep_row, keep_sl, stop, SCAN, BLOCK_L)
    stop = tl.where(leader, stop, first)  # not a leader: an empty window
    tiles = tl.cdiv(tl.maximum(stop - first, 0), BLOCK_L)
    chunk = tl.cdiv(tiles, splits) * BLOCK_L
    lo = first + split * chunk
    hi = tl.minimum(lo + chunk, stop)
    acc, top, total = _window(q, k_ptr + b * k_sb + kv * k_sh, v_ptr + b * v_sb + kv * v_sh, keep_row, k_sl, v_sl,
                              keep_sl, lo, hi, d, d_ok, scale, M_PAD, DIM_PAD, EVEN_D, BLOCK_L, PRECISION, DOT_FP32)
    slot = (row * (tl.num_programs(1) * GROUP) + heads) * slots + split
    tl.store(part_ptr + slot[:, None] * DIM_PAD + d[None, :], acc, mask=m_ok[:, None])
    tl.store(stat_ptr + slot * 2, top, mask=m_ok)
    tl.store(stat_ptr + slot * 2 + 1, total, mask=m_ok)


@triton.jit
def decode_attention_merge(part_ptr, stat_ptr, out_ptr, o_sb, o_sh, heads, splits,
                           DIM: tl.constexpr, DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr):
    # One program per (row, query head): the splits' partial sums rescaled to their common maximum.
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, DIM_PAD)
    s_ok = s < splits
    base = (b * heads + h) * splits
    top = tl.load(stat_ptr + (base + s) * 2, mask=s_ok, other=float("-inf"))
    total = tl.load(stat_ptr + (base + s) * 2 + 1, mask=s_ok, other=0.0)
    best = tl.max(top, 0)
    safe = tl.where(best == float("-inf"), 0.0, best)
    weight = tl.where(top == float("-inf"), 0.0, tl.exp(top - safe))
    norm = tl.sum(weight * total, 0)
    acc = tl.load(part_ptr + (base + s)[:, None] * DIM_PAD + d[None, :], mask=s_ok[:, None], other=0.0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(norm > 0, norm, 1.0)
    tl.store(out_ptr + b * o_sb + h * o_sh + d, out.to(out_ptr.dtype.element_ty), mask=d < DIM)

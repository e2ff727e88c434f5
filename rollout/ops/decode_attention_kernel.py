"""The Triton kernels of :mod:`rollout.ops.decode_attention` (imported only where they run: this module
imports triton). Split-length ("flash-decoding") attention of one query per row, grouped by KV head, and
its shared-prompt form that reads a prompt's keys and values once for all of its samples."""

import triton
import triton.language as tl

from rollout.ops.rms_scaled_kernel import row_rstd, scaled_rotated


@triton.jit
def _first_kept(keep_row, keep_sl, length, SCAN: tl.constexpr, BLOCK_L: tl.constexpr, ALIGN: tl.constexpr):
    # The row's window starts at its first kept column, so no column of its left padding is read (ALIGN: rounded
    # down to a tile edge, which the first-row reads need: their tiles must meet the prompt's end at an edge). The
    # scan reads SCAN columns of the mask at a time and stops at the first block with a kept column (one load for
    # most rows): a scan tile by tile costs a dependent load per tile, ~20 us over 1k columns.
    scan = tl.arange(0, SCAN)
    first = length
    start = 0
    while (first == length) & (start < length):
        cols = start + scan
        kept = tl.load(keep_row + cols * keep_sl, mask=cols < length, other=0) != 0
        first = tl.minimum(first, tl.min(tl.where(kept, cols, length), 0))
        start += SCAN
    if ALIGN:
        first = (first // BLOCK_L) * BLOCK_L
    return first


@triton.jit
def _window(q, k_base, v_base, keep_row, k_sl, v_sl, keep_sl, lo, hi, d, d_ok, scale, k_lead, v_lead, end,
            ROWS: tl.constexpr, DIM_PAD: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_L: tl.constexpr,
            PRECISION: tl.constexpr, DOT_FP32: tl.constexpr, FIRST_ROW: tl.constexpr):
    # An online softmax of the ROWS queries q over columns [lo, hi) of one row's keys and values, in
    # BLOCK_L-column tiles (fp32 scores, probabilities cast to the values' dtype for the second product, as
    # SDPA's flash kernels do): the unnormalised sum, the running maximum and the softmax denominator.
    # DOT_FP32: both products on fp32 operands (only for triton's CPU interpreter, whose bf16 dot is wrong).
    # FIRST_ROW: the tiles wholly before ``end`` are read from k_lead / v_lead instead of k_base / v_base: the same
    # prompt's copy in its run's first row, which the run's other rows read at the same time, so the L2 cache serves
    # them. The same tiles and values as reading k_base / v_base, so bitwise the same result; the tile that holds
    # ``end`` is read from the row's own copy. Two loops, each over one base, keep the tile addresses a step apart
    # (one loop choosing a base per tile took ~40 more registers on sm_90, a third loop for the tile holding ``end``
    # ~60 more).
    top = tl.full((ROWS,), float("-inf"), tl.float32)
    total = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, DIM_PAD), tl.float32)
    if FIRST_ROW:
        edge = tl.minimum(tl.maximum((end // BLOCK_L) * BLOCK_L, lo), hi)  # lo and the tiles: multiples of BLOCK_L
        acc, top, total = _tiles(q, acc, top, total, k_lead, v_lead, keep_row, k_sl, v_sl, keep_sl, lo, edge, hi, d,
                                 d_ok, scale, EVEN_D, BLOCK_L, PRECISION, DOT_FP32)
        acc, top, total = _tiles(q, acc, top, total, k_base, v_base, keep_row, k_sl, v_sl, keep_sl, edge, hi, hi, d,
                                 d_ok, scale, EVEN_D, BLOCK_L, PRECISION, DOT_FP32)
    else:
        acc, top, total = _tiles(q, acc, top, total, k_base, v_base, keep_row, k_sl, v_sl, keep_sl, lo, hi, hi, d,
                                 d_ok, scale, EVEN_D, BLOCK_L, PRECISION, DOT_FP32)
    return acc, top, total


@triton.jit
def _tiles(q, acc, top, total, k_base, v_base, keep_row, k_sl, v_sl, keep_sl, lo, until, hi, d, d_ok, scale,
           EVEN_D: tl.constexpr, BLOCK_L: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    # _window's online softmax carried on over the tiles starting in [lo, until), columns before hi.
    cols0 = tl.arange(0, BLOCK_L)
    for start in range(lo, until, BLOCK_L):
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
def _window_end(length, last_ptr, LAST: tl.constexpr):
    # The window's end: ``length``, or (LAST) column *last_ptr + 1 when that comes first.
    stop = length
    if LAST:
        stop = tl.minimum(stop, tl.load(last_ptr).to(tl.int32) + 1)
    return stop


@triton.jit
def _share(first, stop, share, shares, BLOCK_L: tl.constexpr):
    # Columns [lo, hi) of share ``share`` of ``shares`` of the window [first, stop), in whole tiles.
    tiles = tl.cdiv(tl.maximum(stop - first, 0), BLOCK_L)
    chunk = tl.cdiv(tiles, shares) * BLOCK_L
    lo = first + share * chunk
    return lo, tl.minimum(lo + chunk, stop)


@triton.jit
def _store_partials(part_ptr, stat_ptr, slot, ok, acc, top, total, d, DIM_PAD: tl.constexpr):
    tl.store(part_ptr + slot[:, None] * DIM_PAD + d[None, :], acc, mask=ok[:, None])
    tl.store(stat_ptr + slot * 2, top, mask=ok)
    tl.store(stat_ptr + slot * 2 + 1, total, mask=ok)


@triton.jit
def _run_lead(ids_ptr, b, SAMPLES: tl.constexpr, SAMPLES_PAD: tl.constexpr):
    # The first row of b's run: the rows just before b (at most SAMPLES - 1) whose sample ids share b's
    # id // SAMPLES (the copies of one prompt, adjacent in the batch), read in one load: the run starts after the
    # last row of the SAMPLES up to b that holds another prompt.
    back = tl.arange(0, SAMPLES_PAD)
    rows = b - (SAMPLES - 1) + back
    inside = (back < SAMPLES) & (rows >= 0)
    keys = tl.load(ids_ptr + rows, mask=inside, other=0) // SAMPLES
    other = (back < SAMPLES) & ((rows < 0) | (keys != tl.load(ids_ptr + b) // SAMPLES))
    return tl.maximum(tl.max(tl.where(other, rows, -1), 0) + 1, b - (SAMPLES - 1))


@triton.jit
def _rotary_q_and_write(x_row, h_row, bias_ptr, cos_row, sin_row, col_ptr, col_start, eps, k_base, v_base, k_sl, v_sl,
                        kv, heads, g_ok, split, first, stop, lo, hi, HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr,
                        HEADS: tl.constexpr, KV_HEADS: tl.constexpr, DIM: tl.constexpr, HAS_BIAS: tl.constexpr):
    # decode_attention_split's ROTARY prologue for one (row, KV head, share): the rotated queries of the KV head's
    # query heads ([GROUP_PAD, DIM], rounded to the cache's dtype); k and v of KV head kv written into the cache column
    # *col_ptr (a column of the window from col_start on) by the one share whose tiles hold it (split 0 when none
    # does), which then reads them.
    rstd = row_rstd(h_row, 0, 0, eps, HIDDEN, BLOCK_H)
    d = tl.arange(0, DIM)[None, :]
    c = tl.load(cos_row + d).to(tl.float32)
    s = tl.load(sin_row + d).to(tl.float32)
    q = scaled_rotated(x_row, bias_ptr, heads, g_ok, g_ok, rstd, c, s, DIM, HAS_BIAS).to(k_base.dtype.element_ty)
    col = tl.load(col_ptr).to(tl.int32) - col_start
    held = (col >= lo) & (col < hi)
    if held | ((split == 0) & ((col < first) | (col >= stop))):
        pair = tl.arange(0, 2)  # k, then v
        kv_cols = tl.where(pair == 0, HEADS + kv, HEADS + KV_HEADS + kv)
        y = scaled_rotated(x_row, bias_ptr, kv_cols, pair < 2, pair == 0, rstd, c, s, DIM,
                           HAS_BIAS).to(k_base.dtype.element_ty)
        dest = tl.where(pair == 0, k_base + col * k_sl, v_base + col * v_sl)
        tl.store(dest[:, None] + d, y)
        tl.debug_barrier()  # the share's tile loads below see the column written
    return q


@triton.jit
def decode_attention_split(q_ptr, k_ptr, v_ptr, keep_ptr, out_ptr, part_ptr, stat_ptr, last_ptr, ids_ptr, end_ptr,
                           q_sb, q_sh, k_sb, k_sh, k_sl, v_sb, v_sh, v_sl, keep_sb, keep_sl,
                           o_sb, o_sh, length, splits, scale,
                           h_ptr, bias_ptr, cos_ptr, sin_ptr, col_ptr, h_sb, cos_sb, sin_sb, col_start, eps,
                           GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM: tl.constexpr,
                           DIM_PAD: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_L: tl.constexpr, SCAN: tl.constexpr,
                           SINGLE: tl.constexpr, LAST: tl.constexpr,
                           PRECISION: tl.constexpr, DOT_FP32: tl.constexpr, SAMPLES: tl.constexpr,
                           SAMPLES_PAD: tl.constexpr, ROTARY: tl.constexpr = False, HIDDEN: tl.constexpr = 1,
                           BLOCK_H: tl.constexpr = 1, HEADS: tl.constexpr = 1, KV_HEADS: tl.constexpr = 1,
                           HAS_BIAS: tl.constexpr = False, ALIGN: tl.constexpr = False):
    # One program: row b, KV head kv, one share (split) of the row's key window.
    # The GROUP query heads that share KV head kv are the rows of one tile, so each key and value is read
    # once per KV head. The window: from the row's first kept column to the end (LAST: to column *last_ptr,
    # inclusive: the columns after it are masked for every row, so they are not read). What is left is shared
    # among the splits in whole tiles.
    # SAMPLES > 1: rows whose sample ids (ids_ptr) share id // SAMPLES hold copies of one prompt in columns
    # [0, *end_ptr); each reads them from its run's first row, so the run's rows, launched side by side, read one
    # copy between them from memory (the others hit the L2 cache) and need no pass or merge of their own.
    # ROTARY: q_ptr is the layer's q|k|v product of the raw residual rows h_ptr (q_sb its row stride), whose 1/RMS,
    # bias and rotary (cos_ptr, sin_ptr: [B, DIM]) each program applies to its query heads itself (rms_scaled_kernel's
    # arithmetic); the program whose share holds cache column *col_ptr (col_start: the window's first column; split 0
    # when no share holds it) also writes kv's k (rotated) and v there before it reads its tiles.
    b = tl.program_id(0).to(tl.int64)
    kv = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    g_ok = g < GROUP
    d_ok = d < DIM
    heads = kv * GROUP + g
    k_row, v_row = k_ptr + b * k_sb + kv * k_sh, v_ptr + b * v_sb + kv * v_sh
    if not ROTARY:
        q = tl.load(q_ptr + b * q_sb + heads[:, None] * q_sh + d[None, :], mask=g_ok[:, None] & d_ok[None, :],
                    other=0.0)
    keep_row = keep_ptr + b * keep_sb
    stop = _window_end(length, last_ptr, LAST)
    k_lead, v_lead, end = k_ptr, v_ptr, 0
    if SAMPLES > 1:
        lead = _run_lead(ids_ptr, b, SAMPLES, SAMPLES_PAD)
        k_lead, v_lead = k_ptr + lead * k_sb + kv * k_sh, v_ptr + lead * v_sb + kv * v_sh
        end = tl.load(end_ptr).to(tl.int32)
    first = _first_kept(keep_row, keep_sl, stop, SCAN, BLOCK_L, ALIGN or SAMPLES > 1)
    lo, hi = _share(first, stop, split, splits, BLOCK_L)
    if ROTARY:
        q = _rotary_q_and_write(q_ptr + b * q_sb, h_ptr + b * h_sb, bias_ptr, cos_ptr + b * cos_sb,
                                sin_ptr + b * sin_sb, col_ptr, col_start, eps, k_row, v_row, k_sl, v_sl, kv, heads,
                                g_ok, split, first, stop, lo, hi, HIDDEN, BLOCK_H, HEADS, KV_HEADS, DIM, HAS_BIAS)
    acc, top, total = _window(q, k_row, v_row, keep_row, k_sl, v_sl, keep_sl, lo, hi, d, d_ok, scale, k_lead, v_lead,
                              end, GROUP_PAD, DIM_PAD, EVEN_D, BLOCK_L, PRECISION, DOT_FP32, SAMPLES > 1)
    if SINGLE:  # one split: normalise here; a row with nothing kept gets zeros
        out = acc / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(out_ptr + b * o_sb + heads[:, None] * o_sh + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=g_ok[:, None] & d_ok[None, :])
    else:  # partials [B, Hq, splits, DIM_PAD] and (top, total) [B, Hq, splits, 2], combined by decode_attention_merge
        _store_partials(part_ptr, stat_ptr, (b * (tl.num_programs(1) * GROUP) + heads) * splits + split, g_ok, acc,
                        top, total, d, DIM_PAD)


@triton.jit
def decode_attention_shared(q_ptr, k_ptr, v_ptr, keep_ptr, ids_ptr, end_ptr, last_ptr, part_ptr, stat_ptr,
                            q_sb, q_sh, k_sb, k_sh, k_sl, v_sb, v_sh, v_sl, keep_sb, keep_sl,
                            rows, length, prefix_splits, splits, scale,
                            SAMPLES: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, M_PAD: tl.constexpr,
                            DIM: tl.constexpr, DIM_PAD: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_L: tl.constexpr,
                            SCAN: tl.constexpr, LAST: tl.constexpr, PRECISION: tl.constexpr,
                            DOT_FP32: tl.constexpr, ALIGN: tl.constexpr = False):
    # Rows whose sample ids (ids_ptr) share id // SAMPLES hold copies of the same prompt's keys, values and mask
    # in columns [0, end), end = *end_ptr for every row. One launch, two kinds of program over
    # (row b, KV head kv, share s):
    # - s < prefix_splits, the prompt: if b is the first row of a run of such rows (its leader), its tile holds
    #   the queries of every row of the run (at most SAMPLES) times the GROUP query heads of kv, and it reads
    #   share s of b's prompt columns once for all of them; the other rows' programs do nothing;
    # - s >= prefix_splits, the row's own columns: share s - prefix_splits of [end, *last_ptr] of row b.
    # Both write partials (slot s of each of their rows, prefix_splits + splits slots a row and query head),
    # which decode_attention_merge combines. The two kinds run side by side, so the prompt's programs cost
    # their reads, not a launch and its latency of their own.
    b = tl.program_id(0).to(tl.int64)
    kv = tl.program_id(1)
    share = tl.program_id(2)
    slots = prefix_splits + splits
    d = tl.arange(0, DIM_PAD)
    d_ok = d < DIM
    end = tl.load(end_ptr).to(tl.int32)
    keep_row = keep_ptr + b * keep_sb
    k_base = k_ptr + b * k_sb + kv * k_sh
    v_base = v_ptr + b * v_sb + kv * v_sh
    heads_of_kv = tl.num_programs(1) * GROUP
    if share < prefix_splits:
        key = tl.load(ids_ptr + b) // SAMPLES
        prev = tl.load(ids_ptr + tl.maximum(b - 1, 0)) // SAMPLES
        leader = (b == 0) | (prev != key)
        if leader:
            run = 1  # the run: rows b, b + 1, ... while their prompt is b's
            for j in tl.static_range(1, SAMPLES):
                inside = b + j < rows
                other = tl.load(ids_ptr + b + j, mask=inside, other=0) // SAMPLES
                run = tl.where(inside & (other == key) & (run == j), j + 1, run)
            m = tl.arange(0, M_PAD)
            member = m // GROUP
            heads = kv * GROUP + m % GROUP
            row = b + member
            m_ok = member < run
            q = tl.load(q_ptr + row[:, None] * q_sb + heads[:, None] * q_sh + d[None, :],
                        mask=m_ok[:, None] & d_ok[None, :], other=0.0)
            first = _first_kept(keep_row, keep_sl, end, SCAN, BLOCK_L, ALIGN)
            lo, hi = _share(first, end, share, prefix_splits, BLOCK_L)
            acc, top, total = _window(q, k_base, v_base, keep_row, k_sl, v_sl, keep_sl, lo, hi, d, d_ok, scale, 0, 0,
                                      0, M_PAD, DIM_PAD, EVEN_D, BLOCK_L, PRECISION, DOT_FP32, False)
            _store_partials(part_ptr, stat_ptr, (row * heads_of_kv + heads) * slots + share, m_ok, acc, top, total,
                            d, DIM_PAD)
    else:
        g = tl.arange(0, GROUP_PAD)
        g_ok = g < GROUP
        heads = kv * GROUP + g
        q = tl.load(q_ptr + b * q_sb + heads[:, None] * q_sh + d[None, :], mask=g_ok[:, None] & d_ok[None, :],
                    other=0.0)
        lo, hi = _share(end, _window_end(length, last_ptr, LAST), share - prefix_splits, splits, BLOCK_L)
        acc, top, total = _window(q, k_base, v_base, keep_row, k_sl, v_sl, keep_sl, lo, hi, d, d_ok, scale, 0, 0, 0,
                                  GROUP_PAD, DIM_PAD, EVEN_D, BLOCK_L, PRECISION, DOT_FP32, False)
        _store_partials(part_ptr, stat_ptr, (b * heads_of_kv + heads) * slots + share, g_ok, acc, top, total, d,
                        DIM_PAD)


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

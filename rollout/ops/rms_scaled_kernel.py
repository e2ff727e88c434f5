"""The Triton kernels of :mod:`rollout.ops.rms_scaled` (imported only where triton is)."""

import triton
import triton.language as tl


@triton.jit
def row_rstd(h_ptr, row, stride_h, eps, HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr):
    # 1 / RMS of one residual row, in fp32 as the model's RMSNorm computes it: rsqrt(mean(h^2) + eps).
    offs = tl.arange(0, BLOCK_H)
    h = tl.load(h_ptr + row * stride_h + offs, mask=offs < HIDDEN, other=0.0).to(tl.float32)
    return tl.rsqrt(tl.sum(h * h, axis=0) / HIDDEN + eps)


@triton.jit
def scaled_rotated(row_ptr, bias_ptr, heads, valid, rotate, rstd, c, s, DIM: tl.constexpr, HAS_BIAS: tl.constexpr):
    # [N, DIM] fp32: the q|k|v heads ``heads`` ([N]; ``valid`` masks them) of one row's product times the row's 1/RMS,
    # plus the bias; rotated (x * c + rotate_half(x) * s, c and s fp32 [1, DIM]) where ``rotate`` ([N]). The one
    # arithmetic of rotary_write_rms and of decode attention with the rotary inside (decode_attention_kernel), so the
    # two round alike.
    half: tl.constexpr = DIM // 2
    offs = tl.arange(0, DIM)[None, :]
    partner = tl.where(offs < half, offs + half, offs - half)
    mask = valid[:, None] & (offs < DIM)
    base = row_ptr + heads[:, None] * DIM
    x = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32) * rstd
    xp = tl.load(base + partner, mask=mask, other=0.0).to(tl.float32) * rstd
    if HAS_BIAS:
        x += tl.load(bias_ptr + heads[:, None] * DIM + offs, mask=mask, other=0.0).to(tl.float32)
        xp += tl.load(bias_ptr + heads[:, None] * DIM + partner, mask=mask, other=0.0).to(tl.float32)
    xp = tl.where(offs < half, -xp, xp)
    return tl.where(rotate[:, None], x * c + xp * s, x)


@triton.jit
def rotary_write_rms(qkv_ptr, h_ptr, bias_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, col_ptr, eps,
                     stride_x, stride_h, stride_cos, stride_sin, stride_kb, stride_kh, stride_kc, stride_vb,
                     stride_vh, stride_vc, HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr, HEADS: tl.constexpr,
                     KV_HEADS: tl.constexpr, DIM: tl.constexpr, BLOCK_HEADS: tl.constexpr, HAS_BIAS: tl.constexpr):
    # One program per row, every head of q|k|v at once ([BLOCK_HEADS, DIM]): the product of the raw residual
    # times the row's 1/RMS, plus the bias, in fp32; q and k rotated (x * cos + rotate_half(x) * sin), rounded once;
    # q to its own [B, Hq, 1, D] output, k and v to the cache column ``col``.
    row = tl.program_id(0)
    rstd = row_rstd(h_ptr, row, stride_h, eps, HIDDEN, BLOCK_H)
    head = tl.arange(0, BLOCK_HEADS)
    offs = tl.arange(0, DIM)[None, :]
    c = tl.load(cos_ptr + row * stride_cos + offs).to(tl.float32)
    s = tl.load(sin_ptr + row * stride_sin + offs).to(tl.float32)
    y = scaled_rotated(qkv_ptr + row * stride_x, bias_ptr, head, head < HEADS + 2 * KV_HEADS,
                       head < HEADS + KV_HEADS, rstd, c, s, DIM, HAS_BIAS).to(q_ptr.dtype.element_ty)
    heads = head[:, None]
    valid = (heads < HEADS + 2 * KV_HEADS) & (offs < DIM)
    col = tl.load(col_ptr)
    tl.store(q_ptr + (row * HEADS + heads) * DIM + offs, y, mask=valid & (heads < HEADS))
    kh = tl.maximum(heads - HEADS, 0)
    tl.store(k_ptr + row * stride_kb + kh * stride_kh + col * stride_kc + offs, y,
             mask=valid & (heads >= HEADS) & (heads < HEADS + KV_HEADS))
    vh = tl.maximum(heads - HEADS - KV_HEADS, 0)
    tl.store(v_ptr + row * stride_vb + vh * stride_vh + col * stride_vc + offs, y,
             mask=valid & (heads >= HEADS + KV_HEADS))


@triton.jit
def silu_mul_rms(gate_up_ptr, h_ptr, out_ptr, eps, stride_g, stride_h, stride_o, HIDDEN: tl.constexpr,
                 BLOCK_H: tl.constexpr, INTER: tl.constexpr, BLOCK: tl.constexpr):
    # Program (row, block of the intermediate): silu(g * r) * (u * r) in fp32, rounded once, where g|u is the
    # product of the raw residual row and r its 1/RMS (each program reads the row again: 2 HIDDEN bytes from L2).
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTER
    rstd = row_rstd(h_ptr, row, stride_h, eps, HIDDEN, BLOCK_H)
    g = tl.load(gate_up_ptr + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32) * rstd
    u = tl.load(gate_up_ptr + row * stride_g + INTER + offs, mask=mask, other=0.0).to(tl.float32) * rstd
    tl.store(out_ptr + row * stride_o + offs, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=mask)

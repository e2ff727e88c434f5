"""The Triton kernel of :mod:`rollout.ops.rotary_write` (imported only where triton is)."""

import triton
import triton.language as tl


@triton.jit
def rotary_write(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, col_ptr,
                 stride_x, stride_cos, stride_sin, stride_kb, stride_kh, stride_kc, stride_vb, stride_vh, stride_vc,
                 HEADS: tl.constexpr, KV_HEADS: tl.constexpr, DIM: tl.constexpr):
    # One program per (row, head of q|k|v). q and k heads: x * cos + rotate_half(x) * sin in fp32, rounded once;
    # q goes to its own [B, Hq, 1, D] output, k and v (as it is) to the cache column ``col``.
    row = tl.program_id(0)
    head = tl.program_id(1)
    half: tl.constexpr = DIM // 2
    offs = tl.arange(0, DIM)
    base = qkv_ptr + row * stride_x + head * DIM
    x = tl.load(base + offs)
    col = tl.load(col_ptr)
    if head < HEADS + KV_HEADS:
        partner = tl.where(offs < half, offs + half, offs - half)
        xr = tl.load(base + partner).to(tl.float32)
        xr = tl.where(offs < half, -xr, xr)
        c = tl.load(cos_ptr + row * stride_cos + offs).to(tl.float32)
        s = tl.load(sin_ptr + row * stride_sin + offs).to(tl.float32)
        y = (x.to(tl.float32) * c + xr * s).to(x.dtype)
        if head < HEADS:
            tl.store(q_ptr + (row * HEADS + head) * DIM + offs, y)
        else:
            tl.store(k_ptr + row * stride_kb + (head - HEADS) * stride_kh + col * stride_kc + offs, y)
    else:
        tl.store(v_ptr + row * stride_vb + (head - HEADS - KV_HEADS) * stride_vh + col * stride_vc + offs, x)

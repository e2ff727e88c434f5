"""The Triton kernel of :mod:`rollout.ops.skinny_linear` (imported only where it runs: this module imports
triton)."""

import triton
import triton.language as tl


@triton.jit
def skinny_linear(x_ptr, w_ptr, bias_ptr, norm_ptr, res_ptr, out_ptr, M, N, K, eps,
                  x_sm, w_sn, res_sm, out_sm,
                  NORM: tl.constexpr, BIAS: tl.constexpr, RESIDUAL: tl.constexpr, GLU: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                  PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    # One program: BLOCK_M rows (program_id(1)-th tile; at small batches every row is one tile) against BLOCK_N
    # output columns over the whole of K, so each weight element is read once per row tile and no partial sums
    # leave the program. Rounding follows the step's eager pieces:
    # the normalised row is rounded to the input dtype before the norm weight multiplies it (and again after),
    # the projection is rounded before SiLU, the product and the residual add.
    # NORM: RMSNorm of the rows first (their mean square over all of K, fp32). BIAS: + bias. GLU: the weight
    # is [gate; up] (2N rows), out = silu(x @ gate^T) * (x @ up^T). RESIDUAL: out = residual + the projection.
    # DOT_FP32: products on fp32 operands (only for triton's CPU interpreter, whose bf16 dot is wrong).
    pid = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = rows < M
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    dtype = x_ptr.dtype.element_ty
    if NORM:
        squares = tl.zeros((BLOCK_M,), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + ks
            x = tl.load(x_ptr + rows[:, None] * x_sm + kk[None, :], mask=m_ok[:, None] & (kk < K)[None, :],
                        other=0.0).to(tl.float32)
            squares += tl.sum(x * x, 1)
        rstd = 1.0 / tl.sqrt(squares / K + eps)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if GLU:
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        if EVEN_K:
            x = tl.load(x_ptr + rows[:, None] * x_sm + kk[None, :], mask=m_ok[:, None], other=0.0)
            w = tl.load(w_ptr + cols[:, None] * w_sn + kk[None, :], mask=n_ok[:, None], other=0.0)
        else:
            k_ok = kk < K
            x = tl.load(x_ptr + rows[:, None] * x_sm + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptr + cols[:, None] * w_sn + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if NORM:
            scale = tl.load(norm_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
            normed = (x.to(tl.float32) * rstd[:, None]).to(dtype)
            x = (scale[None, :] * normed.to(tl.float32)).to(dtype)
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision=PRECISION)
        else:
            acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
        if GLU:
            if EVEN_K:
                u = tl.load(w_ptr + (cols + N)[:, None] * w_sn + kk[None, :], mask=n_ok[:, None], other=0.0)
            else:
                u = tl.load(w_ptr + (cols + N)[:, None] * w_sn + kk[None, :], mask=n_ok[:, None] & (kk < K)[None, :],
                            other=0.0)
            if DOT_FP32:
                acc_up += tl.dot(x.to(tl.float32), tl.trans(u.to(tl.float32)), input_precision=PRECISION)
            else:
                acc_up += tl.dot(x, tl.trans(u), input_precision=PRECISION)
    y = acc
    if BIAS:
        y += tl.load(bias_ptr + cols, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if GLU:
        gate = y.to(dtype).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        y = silu * acc_up.to(dtype).to(tl.float32)
    if RESIDUAL:
        residual = tl.load(res_ptr + rows[:, None] * res_sm + cols[None, :], mask=m_ok[:, None] & n_ok[None, :],
                           other=0.0)
        y = y.to(dtype).to(tl.float32) + residual.to(tl.float32)
    tl.store(out_ptr + rows[:, None] * out_sm + cols[None, :], y.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])

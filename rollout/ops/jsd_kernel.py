"""The Triton kernel of :mod:`rollout.ops.jsd` (imported only where triton is)."""

import triton
import triton.language as tl

#: Smallest normal float32: the floor of the mixture before its log (a term whose mixture is below it weighs
#: less than it in every sum, so flooring changes nothing a float32 sum can hold).
_TINY = tl.constexpr(1.1754944e-38)


@triton.jit
def _log_probs(s_row, t_row, idx, ok, inv_tau, lse_s, lse_t):
    """log p_s and log p_t of one block of a row (masked lanes read 0: the callers mask what they add)."""
    log_s = tl.load(s_row + idx, mask=ok, other=0.0).to(tl.float32) * inv_tau - lse_s
    log_t = tl.load(t_row + idx, mask=ok, other=0.0).to(tl.float32) * inv_tau - lse_t
    return log_s, log_t


@triton.jit
def _log_mixture(p_s, p_t, beta):
    """log m, m = beta p_t + (1 - beta) p_s, from the probabilities (one log where logaddexp takes two exps and
    a log), floored at the smallest normal float32."""
    return tl.log(tl.maximum(beta * p_t + (1.0 - beta) * p_s, _TINY))


@triton.jit
def jsd_rows(s_ptr, t_ptr, loss_ptr, stride_s, stride_t, vocab, inv_tau, scale, beta,
             MODE: tl.constexpr, WRITE_GRAD: tl.constexpr, BLOCK: tl.constexpr):
    # One program per row (a loss position). Pass 1: online max and sum of exp of both rows / tau (per lane, then
    # reduced). Pass 2, backwards (its first blocks are the ones pass 1 read last, likelier still in L2): the row's
    # divergence (and, in MODE 0, its gradient). Pass 3 (MODES 1 and 2, whose gradient needs a sum over the row):
    # the gradient. The gradient overwrites the student row in place, scaled by ``scale``.
    # MODE 0: beta 0, KL(t || s), d/dz_s = p_s - p_t. MODE 1: beta 1, KL(s || t), d/dz_s = p_s (d - sum p_s d),
    # d = log p_s - log p_t. MODE 2: beta KL(t || m) + (1 - beta) KL(s || m), m = beta p_t + (1 - beta) p_s,
    # d/dz_s = (1 - beta) (w - p_s sum w), w = p_s (log p_s - log m). Every gradient is divided by tau.
    # Transcendentals per element and row pair: 4 in pass 1 (a one-exp online update with selects measured slower on
    # the H200), then 2 / 1 / 3 (modes 0 / 1 / 2) in pass 2 and 1 / 3 in pass 3.
    row = tl.program_id(0).to(tl.int64)
    s_row = s_ptr + row * stride_s
    t_row = t_ptr + row * stride_t
    offs = tl.arange(0, BLOCK)
    m_s = tl.full([BLOCK], -1e30, tl.float32)
    m_t = tl.full([BLOCK], -1e30, tl.float32)
    l_s = tl.zeros([BLOCK], tl.float32)
    l_t = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        idx = start + offs
        ok = idx < vocab
        s = tl.load(s_row + idx, mask=ok, other=float("-inf")).to(tl.float32) * inv_tau
        t = tl.load(t_row + idx, mask=ok, other=float("-inf")).to(tl.float32) * inv_tau
        new_s = tl.maximum(m_s, s)
        new_t = tl.maximum(m_t, t)
        l_s = l_s * tl.exp(m_s - new_s) + tl.exp(s - new_s)
        l_t = l_t * tl.exp(m_t - new_t) + tl.exp(t - new_t)
        m_s = new_s
        m_t = new_t
    top_s = tl.max(m_s, 0)
    top_t = tl.max(m_t, 0)
    lse_s = top_s + tl.log(tl.sum(l_s * tl.exp(m_s - top_s), 0))
    lse_t = top_t + tl.log(tl.sum(l_t * tl.exp(m_t - top_t), 0))
    acc = tl.zeros([BLOCK], tl.float32)
    acc_w = tl.zeros([BLOCK], tl.float32)
    last = ((vocab - 1) // BLOCK) * BLOCK
    for back in range(0, vocab, BLOCK):
        idx = (last - back) + offs
        ok = idx < vocab
        log_s, log_t = _log_probs(s_row, t_row, idx, ok, inv_tau, lse_s, lse_t)
        if MODE == 0:
            p_t = tl.exp(log_t)
            acc += tl.where(ok, p_t * (log_t - log_s), 0.0)
            if WRITE_GRAD:
                grad = (tl.exp(log_s) - p_t) * (inv_tau * scale)
                tl.store(s_row + idx, grad.to(s_ptr.dtype.element_ty), mask=ok)
        elif MODE == 1:
            acc += tl.where(ok, tl.exp(log_s) * (log_s - log_t), 0.0)
        else:
            p_s = tl.exp(log_s)
            p_t = tl.exp(log_t)
            log_m = _log_mixture(p_s, p_t, beta)
            w = p_s * (log_s - log_m)
            acc += tl.where(ok, beta * p_t * (log_t - log_m) + (1.0 - beta) * w, 0.0)
            acc_w += tl.where(ok, w, 0.0)
    total = tl.sum(acc, 0)
    tl.store(loss_ptr + row, total)
    if MODE != 0:
        if WRITE_GRAD:
            row_sum = tl.sum(acc_w, 0) if MODE == 2 else total
            for start in range(0, vocab, BLOCK):
                idx = start + offs
                ok = idx < vocab
                log_s, log_t = _log_probs(s_row, t_row, idx, ok, inv_tau, lse_s, lse_t)
                p_s = tl.exp(log_s)
                if MODE == 1:
                    grad = p_s * (log_s - log_t - row_sum)
                else:
                    grad = (1.0 - beta) * p_s * (log_s - _log_mixture(p_s, tl.exp(log_t), beta) - row_sum)
                tl.store(s_row + idx, (grad * (inv_tau * scale)).to(s_ptr.dtype.element_ty), mask=ok)

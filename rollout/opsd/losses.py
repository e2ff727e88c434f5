"""Distillation losses over response tokens: the generalized Jensen-Shannon divergence (GKD/OPSD).

Conventions (those of TRL's GKD trainer and DeepSpeed's OPSD code):

* ``beta == 0``: forward KL, ``KL(teacher || student)``.
* ``beta == 1``: reverse KL, ``KL(student || teacher)``.
* otherwise ``beta * KL(teacher || M) + (1 - beta) * KL(student || M)`` with the mixture
  ``M = beta * teacher + (1 - beta) * student``, computed in log space as
  ``logaddexp(log(beta) + log p_t, log(1 - beta) + log p_s)``.

Both logits are divided by ``temperature`` before the softmax. The divergence is summed over the
vocabulary and averaged over the positions where ``mask`` is 1. The teacher is a constant target:
no gradient ever flows into ``teacher_logits``.

Alignment: the logits at position ``t`` predict token ``t + 1``; :func:`response_logit_positions`
builds the mask over logits positions that predict response tokens.

Vocabulary mismatch rule (:func:`align_vocab`): when the teacher and the student have different
vocabulary sizes (e.g. Qwen2.5-3B 151936 vs Qwen2.5-7B 152064, whose extra rows are padding),
only the shared ids ``[0, min(V_s, V_t))`` are compared: ids beyond the smaller vocabulary are
dropped from *both* logits before the softmax, so both distributions are renormalised over the
shared ids. With a top-k teacher, both distributions are renormalised over the teacher's top-k
ids instead (the student's logits are gathered at those ids); every id must be a student id.

Memory: the loss never materialises a float32 ``[B, T, V]`` tensor. The masked positions are
processed ``chunk_size`` at a time; each chunk computes its loss *and* its analytic gradient
w.r.t. the student logits in float32, then writes the gradient (scaled by ``1 / num_positions``,
or ``1 / num_positions_total``) into one buffer of the student logits' shape and dtype. Backward only multiplies that buffer by
the incoming gradient. So peak extra memory is one chunk of float32 temporaries (about
``8 * chunk_size * V * 4`` bytes) plus one student-dtype gradient buffer, which autograd would
allocate for the logits anyway; nothing is recomputed and no per-chunk autograd graph is kept
(unlike ``torch.utils.checkpoint`` per chunk, whose backward would allocate a full-size gradient
for every chunk). The gradient buffer is released by the first backward: backpropagating twice
through one loss raises ``RuntimeError``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from rollout.checks import is_int, is_number

#: Default number of positions per chunk: ~0.6 GiB of float32 temporaries per 1k at V=152k.
DEFAULT_CHUNK_SIZE = 512


def response_logit_positions(attention_mask: torch.Tensor, response_start_idx: torch.Tensor, *,
                             full_length: bool = False) -> torch.Tensor:
    """The mask over logits positions that predict response tokens.

    ``attention_mask`` is ``[N, T]`` over prompt + response (1 on real tokens) and
    ``response_start_idx`` is ``[N]``, the index of each row's first response token. The logits at
    position ``t`` predict token ``t + 1``, so the result is ``attention_mask[:, 1:]`` restricted to
    ``t + 1 >= response_start_idx``: a bool ``[N, T - 1]`` mask aligned with ``logits[:, :-1]``.
    With ``full_length=True`` a last all-False column is appended, giving ``[N, T]`` aligned with
    the unsliced ``logits`` (this spares the gradient copy that slicing the logits costs).
    """
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be 2-D [N, T]; got {tuple(attention_mask.shape)}")
    num_rows, seq_len = attention_mask.shape
    if response_start_idx.shape != (num_rows,):
        raise ValueError(f"response_start_idx must have shape ({num_rows},); "
                         f"got {tuple(response_start_idx.shape)}")
    if response_start_idx.dtype.is_floating_point or response_start_idx.dtype == torch.bool:
        raise ValueError(f"response_start_idx must be an integer tensor; got {response_start_idx.dtype}")
    if num_rows and (int(response_start_idx.min()) < 1 or int(response_start_idx.max()) > seq_len):
        raise ValueError(f"response_start_idx must lie in [1, {seq_len}]")
    start = response_start_idx.to(attention_mask.device)
    target_pos = torch.arange(1, seq_len, device=attention_mask.device)  # target_pos: [T - 1]
    mask = attention_mask[:, 1:].bool() & (target_pos[None, :] >= start[:, None])  # mask: [N, T - 1]
    if full_length:
        mask = F.pad(mask, (0, 1), value=False)  # mask: [N, T]
    return mask


def align_vocab(student_logits: torch.Tensor,
                teacher_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both logits restricted to the shared ids ``[0, min(V_s, V_t))`` of their last dimension.

    Returns views (no copy). The softmax of each view renormalises over the shared ids.
    """
    shared = min(student_logits.shape[-1], teacher_logits.shape[-1])
    return student_logits[..., :shared], teacher_logits[..., :shared]


def _check_scalars(beta: float, temperature: float, chunk_size: int) -> None:
    if not is_number(beta) or not 0.0 <= beta <= 1.0:  # numpy scalars as OPSDConfig takes them
        raise ValueError(f"beta must be a number in [0, 1]; got {beta!r}")
    if not is_number(temperature) or temperature <= 0:
        raise ValueError(f"temperature must be a finite number > 0; got {temperature!r}")
    if not is_int(chunk_size) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1; got {chunk_size!r}")


def _check_shapes(student_logits, teacher_logits, mask, teacher_top_k_ids) -> None:
    if student_logits.dim() != 3:
        raise ValueError(f"student_logits must be 3-D [B, T, V]; got {tuple(student_logits.shape)}")
    if mask.shape != student_logits.shape[:2]:
        raise ValueError(f"mask shape {tuple(mask.shape)} must match student_logits [B, T] = "
                         f"{tuple(student_logits.shape[:2])}")
    if teacher_logits.dim() == 3 and teacher_logits.shape[:2] != student_logits.shape[:2]:
        raise ValueError(f"teacher_logits [B, T] = {tuple(teacher_logits.shape[:2])} must match "
                         f"student_logits [B, T] = {tuple(student_logits.shape[:2])}")
    if teacher_logits.dim() not in (2, 3):
        raise ValueError("teacher_logits must be [B, T, V] or packed [num_positions, V]; got "
                         f"{tuple(teacher_logits.shape)}")
    if teacher_top_k_ids is not None:
        if teacher_top_k_ids.shape != teacher_logits.shape:
            raise ValueError(f"teacher_top_k_ids shape {tuple(teacher_top_k_ids.shape)} must match "
                             f"teacher_logits {tuple(teacher_logits.shape)}")
        if teacher_top_k_ids.dtype.is_floating_point or teacher_top_k_ids.dtype == torch.bool:
            raise ValueError(f"teacher_top_k_ids must be an integer tensor; got {teacher_top_k_ids.dtype}")


def _chunk_divergence(student: torch.Tensor, teacher: torch.Tensor, beta: float, temperature: float,
                      need_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Summed divergence of one chunk (float32 ``[C, V]`` logits) and its gradient w.r.t. ``student``.

    Gradient: with ``g = dL/d(log p_s)`` (``log M`` depends on ``log p_s`` too) the log-softmax
    Jacobian gives ``dL/dz = (g - p_s * sum(g)) / tau``. Beta 0: ``g = -p_t``, so ``p_s - p_t``.
    Beta 1: ``g = p_s * (log p_s - log p_t + 1)``. Otherwise the ``M`` terms cancel to
    ``g = (1 - beta) * p_s * (log p_s - log M)``.
    """
    log_s = F.log_softmax(student / temperature, dim=-1)  # log_s: [C, V]
    log_t = F.log_softmax(teacher / temperature, dim=-1)  # log_t: [C, V]
    p_s = log_s.exp()
    if beta == 0.0:
        p_t = log_t.exp()
        loss = (p_t * (log_t - log_s)).sum()
        grad = (p_s - p_t) if need_grad else None
    elif beta == 1.0:
        diff = log_s - log_t  # diff: [C, V]
        per_pos = (p_s * diff).sum(-1, keepdim=True)  # per_pos: [C, 1]
        loss = per_pos.sum()
        grad = p_s * (diff - per_pos) if need_grad else None
    else:
        log_m = torch.logaddexp(log_t + math.log(beta), log_s + math.log1p(-beta))  # log_m: [C, V]
        s_minus_m = log_s - log_m
        loss = (beta * (log_t.exp() * (log_t - log_m)) + (1.0 - beta) * (p_s * s_minus_m)).sum()
        grad = None
        if need_grad:
            weighted = p_s * s_minus_m
            grad = (1.0 - beta) * (weighted - p_s * weighted.sum(-1, keepdim=True))
    if grad is not None and temperature != 1.0:
        grad = grad / temperature
    return loss, grad


def _chunk_rows(student_logits, teacher_logits, ids, rows, start, stop, vocab):
    """Float32 student and teacher logits of positions ``start:stop`` (plus the student index)."""
    b_idx, t_idx = rows[0][start:stop], rows[1][start:stop]
    packed = teacher_logits.dim() == 2
    teacher = teacher_logits[start:stop] if packed else teacher_logits[b_idx, t_idx]  # [C, V or K]
    if ids is None:
        student = student_logits[b_idx, t_idx, :vocab]  # student: [C, V]
        return student.float(), teacher[:, :vocab].float(), (b_idx, t_idx, slice(0, vocab))
    top_ids = (ids[start:stop] if packed else ids[b_idx, t_idx]).long()  # top_ids: [C, K]
    index = (b_idx[:, None], t_idx[:, None], top_ids)
    return student_logits[index].float(), teacher.float(), index


class _ChunkedJSD(torch.autograd.Function):
    """Loss in forward, chunk by chunk, with the gradient precomputed into one buffer."""

    @staticmethod
    def forward(ctx, student_logits, teacher_logits, ids, rows, beta, temperature, chunk_size, vocab, divisor):
        num_positions = rows[0].numel()
        need_grad = ctx.needs_input_grad[0]
        grad_buffer = torch.zeros_like(student_logits) if need_grad else None
        total = torch.zeros((), dtype=torch.float32, device=student_logits.device)
        for start in range(0, num_positions, chunk_size):
            stop = min(start + chunk_size, num_positions)
            student, teacher, index = _chunk_rows(student_logits, teacher_logits, ids, rows,
                                                  start, stop, vocab)
            loss, grad = _chunk_divergence(student, teacher, beta, temperature, need_grad)
            total += loss
            if grad is None:
                continue
            grad = (grad / divisor).to(grad_buffer.dtype)
            if ids is None:
                grad_buffer[index] = grad  # distinct positions: plain assignment
            else:  # accumulate, so that a repeated id still gets its full gradient
                grad_buffer.index_put_(index, grad, accumulate=True)
        ctx.grad_buffer = grad_buffer
        return total / divisor

    @staticmethod
    def backward(ctx, grad_output):
        grad = ctx.grad_buffer
        if grad is None:
            raise RuntimeError("generalized_jsd_loss: backward ran twice through one loss; its "
                               "gradient buffer is released by the first backward")
        ctx.grad_buffer = None
        return grad.mul_(grad_output.to(grad.dtype)), None, None, None, None, None, None, None, None


def generalized_jsd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                         mask: torch.Tensor, beta: float = 0.5, temperature: float = 1.0, *,
                         chunk_size: int = DEFAULT_CHUNK_SIZE,
                         teacher_top_k_ids: torch.Tensor | None = None,
                         num_positions_total: int | None = None) -> torch.Tensor:
    """Generalized JSD between student and teacher, averaged over the positions where ``mask`` is 1.

    ``student_logits``: ``[B, T, V_s]`` (any float dtype; gradients flow here only).
    ``teacher_logits``: ``[B, T, V_t]`` aligned with the student, or packed ``[N, V_t]`` holding
    only the ``N = mask.sum()`` masked positions in row-major order (what
    :class:`rollout.logit_cache.TeacherLogitCache` stores). With ``teacher_top_k_ids`` (same shape,
    integer ids into the student vocabulary) the last dimension holds the teacher's top-k logits
    and both distributions are renormalised over those ids; otherwise :func:`align_vocab` applies.
    ``mask``: ``[B, T]`` bool or 0/1, aligned with the logits (see :func:`response_logit_positions`).
    ``num_positions_total``: divide the summed divergence by this count instead of ``mask.sum()``
    (one micro-batch of a larger batch: the micro-batches' losses then add up to the batch mean).
    Returns a float32 scalar. See the module docstring for conventions, chunking and memory.
    """
    _check_scalars(beta, temperature, chunk_size)
    _check_shapes(student_logits, teacher_logits, mask, teacher_top_k_ids)
    rows = torch.nonzero(mask.to(student_logits.device) != 0, as_tuple=True)  # 2 x [N]
    num_positions = rows[0].numel()
    if num_positions == 0:
        raise ValueError("mask selects no response position (it is all zeros)")
    divisor = num_positions if num_positions_total is None else num_positions_total
    if isinstance(divisor, bool) or not isinstance(divisor, int) or divisor < num_positions:
        raise ValueError(f"num_positions_total must be None or an int >= the {num_positions} masked "
                         f"positions; got {num_positions_total!r}")
    if teacher_logits.dim() == 2 and teacher_logits.shape[0] != num_positions:
        raise ValueError(f"packed teacher_logits has {teacher_logits.shape[0]} rows but mask "
                         f"selects {num_positions} positions")
    vocab = min(student_logits.shape[-1], teacher_logits.shape[-1])
    if teacher_top_k_ids is not None:
        vocab = student_logits.shape[-1]
        if int(teacher_top_k_ids.min()) < 0 or int(teacher_top_k_ids.max()) >= vocab:
            raise ValueError(f"teacher_top_k_ids must lie in the student vocabulary [0, {vocab})")
    teacher_logits = teacher_logits.detach().to(student_logits.device)
    ids = None if teacher_top_k_ids is None else teacher_top_k_ids.to(student_logits.device)
    if not torch.is_grad_enabled():
        student_logits = student_logits.detach()
    return _ChunkedJSD.apply(student_logits, teacher_logits, ids, rows, float(beta),
                             float(temperature), chunk_size, vocab, divisor)

"""The distillation loss from hidden states: head and generalized JSD fused, chunk by chunk.

:func:`rollout.opsd.losses.generalized_jsd_loss` reads ``[rows, k, V]`` student logits and a
full-vocabulary teacher cache: three full-vocabulary tensors per micro-batch (logits, their gradient,
the cache). Here the student's and the teacher's final hidden states at the loss positions (``[N, H]``
each; the teacher's cache is ``V / H`` = 74x smaller at Qwen2.5's shape) meet their heads inside the
loss, ``chunk_size`` positions at a time: each chunk's logits ``h @ W[:V].T`` exist only while the chunk
is processed, and the chunk's gradient is pushed straight through the head, into the gradient of the
hidden states (``g @ W``) and of the head weight (``g.T @ h``, accumulated in float32). Backward then only
scales the two precomputed gradients. No ``[N, V]`` tensor outlives its chunk.

Conventions are those of ``generalized_jsd_loss`` (it computes each chunk's divergence and its
logit gradient with the same function): ``beta``, ``temperature``, the shared ids ``[0, min(V_s, V_t))``
of both heads (both distributions renormalised over them), the division by the batch's position count
(``divisor``). The teacher is a constant: its hidden states and head get no gradient. Top-k teacher
caches keep the logits path.
"""

from __future__ import annotations

import functools

import torch

from rollout.ops import jsd
from rollout.opsd.losses import _check_scalars, _chunk_divergence

#: Where the JSD kernel runs, a chunk holds this many times ``chunk_size`` positions: the kernel keeps no float32
#: ``[C, V]`` temporaries (two logits buffers in the model's dtype), so 4x the positions take less memory.
KERNEL_CHUNK_FACTOR = 4


def _chunk_loss(student, teacher, beta, temperature, divisor, need_grad, interpret):
    """``(summed divergence, dL/dlogits / divisor in the logits' dtype or None)`` of one chunk's ``[C, V]``
    logits: the kernel (the gradient overwrites ``student``), else the PyTorch reference."""
    def reference():
        loss, grad = _chunk_divergence(student.float(), teacher.float(), beta, temperature, need_grad)
        return loss, None if grad is None else (grad / divisor).to(student.dtype)

    if jsd.unsupported_reason(student, teacher, interpret) is not None:
        return reference()
    fell_back = []
    rows = jsd.jsd_rows(student, teacher, beta, temperature, 1.0 / divisor, write_grad=need_grad,
                        fallback=lambda: fell_back.append(reference()), interpret=interpret)
    if fell_back:
        return fell_back[0]
    return rows.sum(), (student if need_grad else None)


@functools.lru_cache(maxsize=None)
def _has_float32_out_gemm(device_type: str) -> bool:
    """Whether ``torch.addmm(..., out_dtype=torch.float32)`` takes half-precision inputs on this device type (cuBLAS
    accumulating into a float32 output: CUDA on recent PyTorch)."""
    if device_type != "cuda":
        return False
    try:
        half = torch.ones(2, 2, dtype=torch.bfloat16, device=device_type)
        return torch.addmm(half.float(), half, half, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def _add_head_grad(acc, grad: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """``acc + grad.T @ hidden`` in float32 (``acc`` None: the product alone). One GEMM writing float32 where
    cuBLAS can (no half-precision ``[V, H]`` product, copy and add per chunk), else the product, rounded, added."""
    if _has_float32_out_gemm(grad.device.type):
        if acc is None:
            return torch.mm(grad.T, hidden, out_dtype=torch.float32)
        return torch.addmm(acc, grad.T, hidden, out_dtype=torch.float32, out=acc)  # in place: beta 1
    product = (grad.T @ hidden).float()
    return product if acc is None else acc.add_(product)


class _FusedHeadJSD(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, teacher_hidden, teacher_weight, beta, temperature, chunk_size, divisor,
                interpret):
        vocab = min(weight.shape[0], teacher_weight.shape[0])
        head, teacher_head = weight[:vocab], teacher_weight[:vocab]
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = None  # float32 [vocab, H], from the first chunk on
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        probe = hidden.new_empty(1, 1)  # where the chunks' logits will live
        if jsd.unsupported_reason(probe, probe, interpret) is None:
            chunk_size *= KERNEL_CHUNK_FACTOR
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            student = hidden[rows] @ head.T  # [C, V]
            teacher = teacher_hidden[rows] @ teacher_head.T  # [C, V]
            loss, grad = _chunk_loss(student, teacher, beta, temperature, divisor, need_hidden or need_weight,
                                     interpret)
            total += loss
            del teacher
            if grad is None:
                continue
            if need_hidden:
                grad_hidden[rows] = grad @ head
            if need_weight:
                grad_weight = _add_head_grad(grad_weight, grad, hidden[rows])
        ctx.grads = (grad_hidden, grad_weight, weight.shape[0], weight.dtype)
        return total / divisor

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.grads is None:
            raise RuntimeError("fused_jsd_loss: backward ran twice through one loss; its gradients are "
                               "released by the first backward")
        grad_hidden, grad_weight, rows, dtype = ctx.grads
        ctx.grads = None
        scale = grad_output.float()
        if grad_hidden is not None:
            grad_hidden = grad_hidden.mul_(scale.to(grad_hidden.dtype))
        if grad_weight is not None:  # scaled and rounded to the weight's dtype in one pass over the float32 sum
            shared = grad_weight.shape[0]
            out = torch.empty(rows, grad_weight.shape[1], dtype=dtype, device=grad_weight.device)
            torch.mul(grad_weight, scale, out=out[:shared])
            out[shared:].zero_()  # ids past the shared vocabulary get no gradient
            grad_weight = out
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


def fused_jsd_loss(hidden: torch.Tensor, weight: torch.Tensor, teacher_hidden: torch.Tensor,
                   teacher_weight: torch.Tensor, beta: float = 0.5, temperature: float = 1.0, *,
                   chunk_size: int = 512, divisor: int | None = None, interpret: bool = False) -> torch.Tensor:
    """Generalized JSD of ``hidden @ weight.T`` against ``teacher_hidden @ teacher_weight.T`` (see the module
    docstring). ``hidden``/``teacher_hidden``: ``[N, H]`` / ``[N, H_t]`` at the same positions; ``weight``/
    ``teacher_weight``: ``[V_s, H]`` / ``[V_t, H_t]``. Divides the summed divergence by ``divisor`` (default N).
    Returns a float32 scalar; gradients flow into ``hidden`` and ``weight``. Each chunk's divergence runs in the
    JSD kernel of :mod:`rollout.ops.jsd` where it can (``interpret``: also on the CPU, under ``TRITON_INTERPRET=1``),
    else in PyTorch."""
    _check_scalars(beta, temperature, chunk_size)
    if hidden.dim() != 2 or teacher_hidden.dim() != 2 or hidden.shape[0] != teacher_hidden.shape[0]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and teacher_hidden {tuple(teacher_hidden.shape)} must be "
                         "[N, H] at the same N positions")
    if weight.shape[1] != hidden.shape[1] or teacher_weight.shape[1] != teacher_hidden.shape[1]:
        raise ValueError(f"head weights {tuple(weight.shape)} / {tuple(teacher_weight.shape)} do not match the hidden "
                         f"sizes {hidden.shape[1]} / {teacher_hidden.shape[1]}")
    if hidden.shape[0] == 0:
        raise ValueError("no loss position (hidden has 0 rows)")
    divisor = hidden.shape[0] if divisor is None else divisor
    if isinstance(divisor, bool) or not isinstance(divisor, int) or divisor < hidden.shape[0]:
        raise ValueError(f"divisor must be an int >= the {hidden.shape[0]} positions; got {divisor!r}")
    teacher_hidden = teacher_hidden.detach().to(device=hidden.device, dtype=hidden.dtype)
    teacher_weight = teacher_weight.detach().to(device=hidden.device, dtype=hidden.dtype)
    if not torch.is_grad_enabled():
        hidden, weight = hidden.detach(), weight.detach()
    return _FusedHeadJSD.apply(hidden, weight, teacher_hidden, teacher_weight, float(beta), float(temperature),
                               chunk_size, divisor, interpret)

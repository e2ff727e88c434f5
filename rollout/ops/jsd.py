"""The generalized JSD of rows of logits and its gradient, in one Triton kernel: the fused loss's non-GEMM part.

``jsd_rows(student, teacher, beta, temperature, scale)`` takes ``[C, V]`` student and teacher logits (the
shared vocabulary, any float dtype, rows contiguous) and returns the per-row divergence ``[C]`` (float32); with
``write_grad`` it overwrites ``student`` with ``scale * dL/dz_s`` in place (rounded once to the logits' dtype).
Conventions, formulas and gradients are those of :func:`rollout.opsd.losses._chunk_divergence` (its PyTorch
reference), computed in float32 with an online softmax: two or three passes over each row's two logits rows and
one write, where the PyTorch path makes about ten float32 ``[C, V]`` temporaries.

Where the kernel cannot run (no triton, not CUDA unless ``interpret``, rows that are not contiguous) the caller
runs the PyTorch reference (:func:`unsupported_reason` says why); a kernel that fails to compile or launch warns
once and leaves the reference to every later call on that device (:mod:`rollout.ops.fallback`).
"""

from __future__ import annotations

from typing import Optional

import torch

from rollout.ops.decode_attention import available
from rollout.ops.fallback import launch_or_fall_back

#: Vocabulary entries per block of a pass (a power of two) and warps per program: 8 entries a thread (57-64
#: registers). On the H200 (``python -m benchmarks.jsd``, 2,048 x 151,936 bf16 rows; docs/BENCHMARKS.md section 8)
#: 16 entries a thread (4096 x 8: 127-156 registers, so 1-2 programs an SM) took 2.18-2.29 ms a chunk at beta 0.5 in
#: every kernel timed so, against 1.71-1.77 ms for this one at 8 (1024 x 4, 2048 x 8, 4096 x 16).
BLOCK = 2048
WARPS = 8
_FAILED: dict = {}
"""device -> why the kernel failed there."""


def unsupported_reason(student: torch.Tensor, teacher: torch.Tensor, interpret: bool = False) -> Optional[str]:
    """None when :func:`jsd_rows` runs the kernel on these inputs; else why the caller's PyTorch path runs."""
    if available() is not None:
        return available()
    if not interpret and not student.is_cuda:
        return "not a CUDA tensor"
    if student.dim() != 2 or student.shape != teacher.shape:
        return f"logits must be two [C, V] tensors of one shape; got {tuple(student.shape)} and {tuple(teacher.shape)}"
    if student.stride(1) != 1 or teacher.stride(1) != 1:
        return "rows must be contiguous"
    return _FAILED.get(str(student.device))


def mode(beta: float) -> int:
    """The kernel's formula: 0 forward KL (beta 0), 1 reverse KL (beta 1), 2 the generalized JSD."""
    return 0 if beta == 0.0 else (1 if beta == 1.0 else 2)


def jsd_rows(student: torch.Tensor, teacher: torch.Tensor, beta: float, temperature: float, scale: float, *,
             write_grad: bool = True, fallback=None, interpret: bool = False) -> torch.Tensor:
    """Per-row divergence ``[C]`` float32 (module docstring); ``fallback()`` runs if the launch fails."""
    return launch_or_fall_back(
        _FAILED, str(student.device), "JSD kernel", f"the PyTorch loss runs instead on {student.device}",
        lambda: _launch(student, teacher, beta, temperature, scale, write_grad), fallback)


def _launch(student, teacher, beta, temperature, scale, write_grad) -> torch.Tensor:
    from rollout.ops import jsd_kernel

    rows, vocab = student.shape
    losses = torch.empty(rows, dtype=torch.float32, device=student.device)
    if rows == 0:
        return losses
    jsd_kernel.jsd_rows[(rows,)](
        student, teacher, losses, student.stride(0), teacher.stride(0), vocab, 1.0 / temperature, float(scale),
        float(beta), MODE=mode(beta), WRITE_GRAD=write_grad, BLOCK=BLOCK, num_warps=WARPS)
    return losses

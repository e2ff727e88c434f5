"""``out += x @ weight.T`` with the inner dimension cut into equal chunks: one strided batched GEMM with fp32
outputs, then one kernel that adds their sum into ``out`` (:func:`addmm_split_`).

Why: a decode step's down projection at 256 rows (``[256, 11008] @ [11008, 2048]``) has only 32 output tiles of
128 x 128 for 132 multiprocessors, so cuBLAS cuts its inner dimension itself (split-K on 128 x 64 tiles, then its own
reduction kernel): 0.93 ms over 36 layers on an H200 against a compute floor of 0.52 ms (``docs/BENCHMARKS.md``,
section 1; this form's figures: section 10). Here the chunks are the batch of one ``bmm`` (no copy: strided views of
``x`` and ``weight``), so cuBLAS picks its tiles for a ``[splits, rows, K / splits] @ [splits, K / splits, N]``
problem, and the reduction adds the residual in the same pass. The arithmetic is that of ``addmm_``: fp32
accumulation, the residual added in fp32, one rounding into ``out``'s dtype (the sum's order differs, as between
cuBLAS's own kernels).

Where it cannot run (not CUDA unless ``interpret``, no triton, one split, an inner dimension that ``splits`` does not
divide, operands other than 2-D with contiguous rows, or a ``bmm`` without fp32 outputs) ``out.addmm_`` runs; a
kernel that fails to compile or launch warns once and leaves ``addmm_`` to every later call on that device.
"""

from __future__ import annotations

from typing import Optional

import torch

from rollout.ops.decode_attention import available
from rollout.ops.fallback import launch_or_fall_back

DOWN_SPLITS = 2
"""Chunks of the down projection's inner dimension where ``RolloutConfig.kernels.down_split_rows`` applies (36 layers at
256 rows: on an H100 1.021 ms with 2, 1.045 with 4, 1.286 with 8, against cuBLASLt's 1.218; on an H200 0.87, 0.85, 1.00
against 0.92, but the whole step lost 1.6% there with 2)."""
BLOCK = 1024
"""Elements of ``out`` one program of the reduction adds."""

_FAILED: dict = {}
"""device -> why the kernel (or the fp32-output ``bmm``) failed there."""


def failure(device: torch.device) -> Optional[str]:
    return _FAILED.get(str(device))


def unsupported_reason(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, splits: int,
                       interpret: bool = False) -> Optional[str]:
    """None when :func:`addmm_split_` cuts the product into ``splits`` chunks; else why ``addmm_`` runs."""
    if splits < 2:
        return "one split"
    if available() is not None:
        return available()
    if not interpret and not out.is_cuda:
        return "not a CUDA tensor"
    if any(t.dim() != 2 or t.stride(1) != 1 for t in (out, x, weight)) or not out.is_contiguous():
        return "out, x and weight must be 2-D with contiguous rows (out contiguous)"
    if x.shape[1] != weight.shape[1] or out.shape != (x.shape[0], weight.shape[0]):
        return f"shapes out {tuple(out.shape)}, x {tuple(x.shape)}, weight {tuple(weight.shape)} do not match"
    if x.shape[1] % splits:
        return f"{splits} splits do not divide the inner dimension {x.shape[1]}"
    return _FAILED.get(str(out.device))


def chunks(x: torch.Tensor, weight: torch.Tensor, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` and ``weight [N, K]`` as ``[splits, M, K / splits]`` and ``[splits, K / splits, N]`` views (no
    copy): chunk ``s`` holds inner indices ``[s K / splits, (s + 1) K / splits)``."""
    part = x.shape[1] // splits
    xs = x.as_strided((splits, x.shape[0], part), (part, x.stride(0), 1))
    ws = weight.as_strided((splits, part, weight.shape[0]), (part, 1, weight.stride(0)))
    return xs, ws


def partial_products(x: torch.Tensor, weight: torch.Tensor, splits: int) -> torch.Tensor:
    """``[splits, M, N]`` fp32: each chunk's product, accumulated and kept in fp32 (``bmm`` with fp32 outputs on
    CUDA; off CUDA the chunks are widened to fp32 first, which is what the GPU's accumulation computes)."""
    xs, ws = chunks(x, weight, splits)
    if x.is_cuda:
        return torch.bmm(xs, ws, out_dtype=torch.float32)
    return torch.bmm(xs.float(), ws.float())


def add_partials_(out: torch.Tensor, partials: torch.Tensor, interpret: bool = False) -> torch.Tensor:
    """``out += partials.sum(0)`` in fp32, rounded once into ``out`` (in place; the kernel's one pass)."""
    from rollout.ops import split_k_kernel

    numel = out.numel()
    split_k_kernel.add_partials[(-(-numel // BLOCK),)](out, partials, numel, SPLITS=partials.shape[0],
                                                             BLOCK=BLOCK, num_warps=4)
    return out


def addmm_split_reference(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, splits: int) -> torch.Tensor:
    """The same result in PyTorch, in the kernel's order: the residual in fp32, plus each chunk's fp32 product in turn,
    rounded once into ``out``."""
    total = out.float()
    for part in partial_products(x, weight, splits):
        total += part
    return out.copy_(total)


def addmm_split_(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, splits: int,
                 interpret: bool = False) -> torch.Tensor:
    """``out += x @ weight.T`` in place (``out.addmm_(x, weight.t())``), the inner dimension in ``splits`` chunks
    (module docstring); ``addmm_`` where that cannot run. ``interpret``: allow CPU tensors (tests, under
    ``TRITON_INTERPRET=1``)."""
    if unsupported_reason(out, x, weight, splits, interpret) is not None:
        return out.addmm_(x, weight.t())
    return launch_or_fall_back(_FAILED, str(out.device), "split-K GEMM", "addmm_ runs instead",
                               lambda: add_partials_(out, partial_products(x, weight, splits), interpret),
                               lambda: out.addmm_(x, weight.t()))


def add_down(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, *, min_rows: int, splits: int = DOWN_SPLITS,
             interpret: bool = False) -> torch.Tensor:
    """A decode step's down projection added into the residual ``out`` (``StepFns.add_down``): in ``splits`` chunks
    (:func:`addmm_split_`) at ``min_rows`` rows or more, else ``out.addmm_``."""
    if out.shape[0] >= min_rows:
        return addmm_split_(out, x, weight, splits, interpret)
    return out.addmm_(x, weight.t())

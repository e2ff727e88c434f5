"""A decode step's projections at small batches as Triton kernels, with their neighbours fused in.

``skinny_linear(x, weight, bias, norm=None, eps=0.0, residual=None, glu=False)`` computes, for ``x [M, K]`` and
``weight [N, K]`` (``[2N, K]``, gate rows then up rows, with ``glu``):

- ``norm`` (an RMSNorm weight ``[K]``): the rows are normalised first, as :func:`rollout.ops.norm.rms_norm`;
- ``bias [N]`` added to the projection;
- ``glu``: ``silu(x @ gate^T) * (x @ up^T)`` (the SiLU MLP's first half, over the fused gate|up copy);
- ``residual [M, N]``: ``residual + projection`` (the residual adds after the o and down projections).

Why: at decode batches of a few rows the step's GEMMs are bandwidth-bound, and on an H200 the o GEMM (8.4 MB of
weights) ran at 35% of the copy rate through cuBLAS, with one more kernel to copy the residual into its output
(``docs/BENCHMARKS.md``, "where an 8-row step goes"). Here a program takes every row against a few output columns
over the whole of K: each weight is read once, no partial sums are written, and the norm, bias, SiLU·mul and
residual are done in the same kernel.

Measured on an H200 (3B shape, 36 layers, ``python -m benchmarks.decode_step --parts skinny``, 2026-12-01): o with
its residual took 0.206 ms against the compiled piece's 0.270 at 8 rows (0.236 against 0.305 at 32), so the
routes use it for o (``RolloutConfig.kernels.skinny_rows``). The other projections lost to cuBLAS: q|k|v with the norm
0.447 against 0.299, gate|up with the norm and SiLU·mul 1.13-2.3 against 1.07, down with the residual 0.667
against 0.638 at 8 rows; those forms stay here for the benchmark and the tests.

Wide batches: with ``block_m`` set the rows are cut into tiles of ``block_m`` (a second grid axis), so the same
kernel is a tiled GEMM of many small programs (``--parts skinny --rows 128 256`` times such launches). On an
H200 it lost to the compiled pieces' cuBLAS GEMMs in every form at 128 and 256 rows but one: o with its residual
at 128 rows, 0.269 ms (block 64 x 32 x 128) against 0.295 for 36 layers; at 256 rows cuBLAS ran o at 259
TFLOP/s and q|k|v at 264 (``docs/BENCHMARKS.md``, "2026-12-01 (23:20 UTC session)"). The routes do not use it.

Without ``block_m`` it is meant for ``M <= MAX_ROWS``; beyond, and where the kernel cannot run (no triton, not CUDA
unless ``interpret``, a strided row or weight, other dtypes than bf16/fp16/fp32), the same arithmetic runs in
PyTorch (:func:`skinny_linear_reference`); a kernel that fails to compile or launch warns once and leaves the
PyTorch path to every later call on that device.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from rollout.checks import pow2_at_least
from rollout.ops.decode_attention import available
from rollout.ops.dot_options import dot_options
from rollout.ops.fallback import launch_or_fall_back
from rollout.ops.norm import rms_norm

#: The most rows the kernel takes (all rows are one tile).
MAX_ROWS = 64
#: Output columns per program, K per step of its loop, warps and pipelining stages (launch parameters;
#: ``python -m benchmarks.decode_step --parts skinny`` times others; these were the o projection's best at 8 rows).
BLOCK_N = 16
BLOCK_K = 256
WARPS = 2
STAGES = 4

_FAILED: dict = {}
"""device -> why the kernel failed there."""


def unsupported_reason(x: torch.Tensor, weight: torch.Tensor, interpret: bool = False,
                       tiled: bool = False) -> Optional[str]:
    """None when :func:`skinny_linear` runs the kernel on these inputs (``tiled``: with ``block_m`` set); else
    why the PyTorch path runs."""
    if available() is not None:
        return available()
    if not interpret and not x.is_cuda:
        return "not a CUDA tensor"
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        return f"x {tuple(x.shape)} and weight {tuple(weight.shape)} are not [M, K] and [N, K]"
    if x.shape[0] > MAX_ROWS and not tiled:
        return f"{x.shape[0]} rows > {MAX_ROWS} (set block_m to tile the rows)"
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or x.dtype != weight.dtype:
        return f"dtypes {x.dtype}/{weight.dtype}"
    if x.stride(1) != 1 or weight.stride(1) != 1:
        return "rows of x and weight must be contiguous"
    return _FAILED.get(str(x.device))


def failure(device: torch.device) -> Optional[str]:
    return _FAILED.get(str(device))


def skinny_linear_reference(x, weight, bias=None, norm=None, eps: float = 0.0, residual=None, glu: bool = False):
    """The same result with the step's own arithmetic (``rms_norm``, ``F.linear``, ``F.silu``): the fallback
    and the tests' reference."""
    y = F.linear(x if norm is None else rms_norm(x, norm, eps), weight, bias)
    if glu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y if residual is None else residual + y


def skinny_linear(x, weight, bias=None, norm=None, eps: float = 0.0, residual=None, glu: bool = False, *,
                  interpret: bool = False, block_n: int = BLOCK_N, block_k: int = BLOCK_K, warps: int = WARPS,
                  stages: int = STAGES, block_m: Optional[int] = None) -> torch.Tensor:
    """``[M, N]`` (module docstring); ``interpret``: allow CPU tensors (tests, under ``TRITON_INTERPRET=1``);
    ``block_n``, ``block_k``, ``warps``, ``stages``: launch parameters (module constants); ``block_m``: rows per
    tile (a power of two >= 16; None: every row in one tile, at most ``MAX_ROWS``)."""
    if block_m is not None and (block_m < 16 or block_m & (block_m - 1)):
        raise ValueError(f"block_m: must be a power of two >= 16 or None; got {block_m!r}")
    if glu and weight.shape[0] % 2:
        raise ValueError(f"glu needs [gate; up] with an even number of rows, got weight {tuple(weight.shape)}")
    out_shape = (x.shape[0], weight.shape[0] // 2 if glu else weight.shape[0])
    if residual is not None and tuple(residual.shape) != out_shape:
        raise ValueError(f"residual {tuple(residual.shape)} must match the output {out_shape}")
    if (unsupported_reason(x, weight, interpret, tiled=block_m is not None) is not None
            or (residual is not None and residual.stride(1) != 1)):
        return skinny_linear_reference(x, weight, bias, norm, eps, residual, glu)
    return launch_or_fall_back(
        _FAILED, str(x.device), "skinny linear kernel", f"the PyTorch path runs instead on {x.device}",
        lambda: _launch(x, weight, bias, norm, eps, residual, glu, block_n=block_n, block_k=block_k, warps=warps,
                        stages=stages, block_m=block_m),
        lambda: skinny_linear_reference(x, weight, bias, norm, eps, residual, glu))


def _launch(x, weight, bias, norm, eps, residual, glu, *, block_n, block_k, warps, stages, block_m) -> torch.Tensor:
    from rollout.ops import skinny_linear_kernel as kernels

    rows, k = x.shape
    n = weight.shape[0] // 2 if glu else weight.shape[0]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    block_k = min(block_k, pow2_at_least(k, 16))
    block_m = block_m or pow2_at_least(rows, 16)
    kernels.skinny_linear[(-(-n // block_n), -(-rows // block_m))](
        x, weight, bias if bias is not None else x, norm if norm is not None else x,
        residual if residual is not None else x, out, rows, n, k, float(eps),
        x.stride(0), weight.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
        NORM=norm is not None, BIAS=bias is not None, RESIDUAL=residual is not None, GLU=glu,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        **dot_options(x.dtype, x.is_cuda),
        num_warps=warps, num_stages=stages)
    return out

"""How our Triton kernels' ``tl.dot`` products are asked to run: the one definition that decode attention
(:mod:`rollout.ops.decode_attention`) and the skinny linear (:mod:`rollout.ops.skinny_linear`) pass as their
``PRECISION`` and ``DOT_FP32`` constexprs, and that ``scripts/check_kernels.py`` asks for as on CUDA when it
compiles the kernels for a GPU on a machine without one."""

from __future__ import annotations

import torch


def dot_options(dtype: torch.dtype, on_cuda: bool) -> dict:
    """``PRECISION``: ``"tf32"`` for 16-bit operands on CUDA (their products are exact in it; fp32 accumulates),
    ``"ieee"`` for fp32 or off CUDA; ``DOT_FP32``: 16-bit operands widened to fp32 first, only off CUDA (Triton's
    CPU interpreter computes 16-bit dots wrongly)."""
    return {"PRECISION": "ieee" if dtype == torch.float32 or not on_cuda else "tf32",
            "DOT_FP32": not on_cuda and dtype != torch.float32}

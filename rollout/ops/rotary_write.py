"""The rotary of a decode step's q and k and the cache writes of k and v, as one Triton kernel per layer.

``rotary_write(qkv, cos, sin, key_layer, value_layer, cols, *, heads, kv_heads, head_dim)`` takes the fused
q|k|v projection ``[B, (Hq + 2 Hkv) D]`` of one decode step (bias included), ``cos``/``sin`` ``[B, 1, 1, D]``
(:func:`rollout.model.pieces.rotary`), one layer's cache ``key_layer``/``value_layer [B, Hkv, capacity, D]`` (any
strides with a contiguous last dimension) and the column ``cols [1]`` (a device tensor, so captured graphs
replay it at every step); it writes k (rotated) and v into that column and returns the rotated q
``[B, Hq, 1, D]``, as :func:`rollout.model.pieces.attention_inputs_qkv_write` does after its projection.

Why: under ``torch.compile`` those writes take three elementwise kernels a layer (q's rotary, k's rotary and
write, v's write); here they take one. The rotary is computed in fp32 and rounded once, as inductor's kernels
compute it. Where the kernel cannot run (no triton, not CUDA unless ``interpret``, a head dimension that is not
a power of two, a cache whose last dimension is strided) the same arithmetic runs in PyTorch; a kernel that
fails to compile or launch warns once and leaves the PyTorch path to every later call on that device.
"""

from __future__ import annotations

from typing import Optional

import torch

from rollout.ops.decode_attention import available
from rollout.ops.fallback import launch_or_fall_back

_FAILED: dict = {}
"""device -> why the kernel failed there."""


def unsupported_reason(qkv: torch.Tensor, key_layer: torch.Tensor, value_layer: torch.Tensor, head_dim: int,
                       interpret: bool = False) -> Optional[str]:
    """None when :func:`rotary_write` runs the kernel on these inputs; else why the PyTorch path runs."""
    return input_problem(qkv, key_layer, value_layer, head_dim, interpret) or _FAILED.get(str(qkv.device))


def input_problem(qkv: torch.Tensor, key_layer: torch.Tensor, value_layer: torch.Tensor, head_dim: int,
                  interpret: bool = False) -> Optional[str]:
    """Why a rotary and cache-write kernel cannot take these inputs (this module's, or
    :func:`rollout.ops.rms_scaled.rotary_write_rms`), recorded failures aside; None when it can."""
    if available() is not None:
        return available()
    if not interpret and not qkv.is_cuda:
        return "not a CUDA tensor"
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"head dimension {head_dim} is not a power of two >= 16"
    if qkv.dim() != 2 or qkv.stride(1) != 1 or key_layer.stride(3) != 1 or value_layer.stride(3) != 1:
        return "q|k|v rows and the cache's head dimension must be contiguous"
    return None


def failure(device: torch.device) -> Optional[str]:
    return _FAILED.get(str(device))


def rotary_write_reference(qkv, cos, sin, key_layer, value_layer, cols, *, heads: int, kv_heads: int,
                           head_dim: int):
    """The same result in PyTorch (fp32 rotary, rounded once): the fallback and the tests' reference."""
    return rotate_and_write(qkv.float(), cos, sin, key_layer, value_layer, cols, heads=heads, kv_heads=kv_heads,
                            head_dim=head_dim, dtype=qkv.dtype)


def rotate_and_write(x, cos, sin, key_layer, value_layer, cols, *, heads: int, kv_heads: int, head_dim: int,
                     dtype: torch.dtype):
    """The PyTorch arithmetic after the kernels' input (this module's and
    :func:`rollout.ops.rms_scaled.rotary_write_rms`'s): q and k of the fp32 ``x [B, (Hq + 2 Hkv) D]`` rotated, each
    result rounded once to ``dtype``; k and v written into the cache column ``cols``; q ``[B, Hq, 1, D]`` returned."""
    batch = x.shape[0]
    q, k, v = x.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    half = head_dim // 2
    c, s = cos.reshape(batch, 1, head_dim).float(), sin.reshape(batch, 1, head_dim).float()

    def rotate(y, n):
        y = y.reshape(batch, n, head_dim)
        return (y * c + torch.cat((-y[..., half:], y[..., :half]), dim=-1) * s).to(dtype)

    key_layer.index_copy_(2, cols, rotate(k, kv_heads).unsqueeze(2))
    value_layer.index_copy_(2, cols, v.reshape(batch, kv_heads, 1, head_dim).to(dtype))
    return rotate(q, heads).unsqueeze(2)


def rotary_write(qkv, cos, sin, key_layer, value_layer, cols, *, heads: int, kv_heads: int, head_dim: int,
                 interpret: bool = False) -> torch.Tensor:
    """Rotated q ``[B, Hq, 1, D]``; k (rotated) and v written into the cache column ``cols`` (module docstring)."""
    shape = dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    if unsupported_reason(qkv, key_layer, value_layer, head_dim, interpret) is not None:
        return rotary_write_reference(qkv, cos, sin, key_layer, value_layer, cols, **shape)
    return launch_or_fall_back(
        _FAILED, str(qkv.device), "rotary/cache-write kernel", f"the PyTorch path runs instead on {qkv.device}",
        lambda: _launch(qkv, cos, sin, key_layer, value_layer, cols, **shape),
        lambda: rotary_write_reference(qkv, cos, sin, key_layer, value_layer, cols, **shape))


def _launch(qkv, cos, sin, key_layer, value_layer, cols, *, heads, kv_heads, head_dim) -> torch.Tensor:
    from rollout.ops import rotary_write_kernel as kernels

    batch = qkv.shape[0]
    q = torch.empty(batch, heads, 1, head_dim, dtype=qkv.dtype, device=qkv.device)
    cos2, sin2 = cos.reshape(batch, head_dim), sin.reshape(batch, head_dim)
    kernels.rotary_write[(batch, heads + 2 * kv_heads)](
        qkv, cos2, sin2, q, key_layer, value_layer, cols,
        qkv.stride(0), cos2.stride(0), sin2.stride(0), key_layer.stride(0), key_layer.stride(1), key_layer.stride(2),
        value_layer.stride(0), value_layer.stride(1), value_layer.stride(2),
        HEADS=heads, KV_HEADS=kv_heads, DIM=head_dim, num_warps=1)
    return q

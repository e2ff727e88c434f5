"""A decode step's two consumers of an RMSNorm whose gain is folded into the next weights
(``RolloutConfig.kernels.fold_norms``): each scales the product of the raw residual by the row's 1/RMS itself.

``rms_norm(h, gain) @ W.T`` equals ``rstd(h) * (h @ (W * gain).T)`` with ``rstd(h) = rsqrt(mean(h^2) + eps)`` per row.
With the gains folded into the fused q|k|v and gate|up copies (:class:`rollout.model.weights.FusedQKV`,
:class:`~rollout.model.weights.FusedGateUp`), a decode step's GEMMs read the residual stream itself, and
the row's 1/RMS is computed where the product is consumed:

- ``rotary_write_rms(qkv, h, bias, cos, sin, key_layer, value_layer, cols, *, eps, heads, kv_heads, head_dim)``:
  :func:`rollout.ops.rotary_write.rotary_write` of ``qkv * rstd(h) + bias`` (``qkv = h @ Wqkv.T``, no bias);
- ``silu_mul_rms(gate_up, h, *, eps)``: ``silu(g * rstd(h)) * (u * rstd(h))`` of ``gate_up = h @ Wgu.T = [g | u]``.

Why: a norm kernel a layer and norm (73 launches of ~2 us in the 3B step at 256 rows) goes; the row's RMS costs each
program a read of one residual row (4 KB at hidden size 2048) from L2. Arithmetic is in fp32, rounded once. Where the
kernels cannot run (no triton, not CUDA unless ``interpret``, a head dimension that is not a power of two, strided
rows) the same arithmetic runs in PyTorch; a kernel that fails to compile or launch warns once and leaves the PyTorch
path to every later call on that device.
"""

from __future__ import annotations

from typing import Optional

import torch

from rollout.checks import is_int, pow2_at_least, require
from rollout.ops.decode_attention import available, sm_count
from rollout.ops.fallback import launch_or_fall_back
from rollout.ops.rotary_write import input_problem, rotate_and_write

_FAILED: dict = {}
"""device -> why a kernel of this module failed there."""

PROGRAMS_PER_SM = 4
"""``silu_mul_rms`` splits each row into blocks (of 512 columns at least) until the grid has about this many
programs per streaming multiprocessor."""


def failure(device: torch.device) -> Optional[str]:
    return _FAILED.get(str(device))


def unsupported_reason(product: torch.Tensor, h: torch.Tensor, interpret: bool = False) -> Optional[str]:
    """None when the kernels run on a product and its residual rows ``h``; else why the PyTorch path runs."""
    if available() is not None:
        return available()
    if not interpret and not product.is_cuda:
        return "not a CUDA tensor"
    if any(t.dim() != 2 or t.stride(1) != 1 for t in (product, h)):
        return "the product and residual rows must be 2-D with contiguous rows"
    return _FAILED.get(str(product.device))


def rotary_problem(qkv, h, key_layer, value_layer, head_dim: int, interpret: bool = False) -> Optional[str]:
    """None when :func:`rotary_write_rms` runs its kernel; else why the PyTorch path runs (the rotary kernel's input
    rules, :func:`rollout.ops.rotary_write.input_problem`, then this module's)."""
    return input_problem(qkv, key_layer, value_layer, head_dim, interpret) or unsupported_reason(qkv, h, interpret)


def rstd(h: torch.Tensor, eps: float) -> torch.Tensor:
    """``[B, 1]`` fp32: 1 / RMS of each row of ``h``, as the model's RMSNorm computes it."""
    return torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + eps)


def rotary_write_rms_reference(qkv, h, bias, cos, sin, key_layer, value_layer, cols, *, eps: float, heads: int,
                               kv_heads: int, head_dim: int):
    """The same result in PyTorch (fp32 from the product to the rotary, rounded once): the fallback and the tests'
    reference."""
    x = qkv.float() * rstd(h, eps)
    return rotate_and_write(x if bias is None else x + bias.float(), cos, sin, key_layer, value_layer, cols,
                            heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=qkv.dtype)


def silu_mul_rms_reference(gate_up, h, *, eps: float):
    """The same result in PyTorch: ``silu(g * r) * (u * r)`` in fp32, rounded once."""
    g, u = (gate_up.float() * rstd(h, eps)).chunk(2, dim=-1)
    return (torch.nn.functional.silu(g) * u).to(gate_up.dtype)


def rotary_write_rms(qkv, h, bias, cos, sin, key_layer, value_layer, cols, *, eps: float, heads: int,
                     kv_heads: int, head_dim: int, interpret: bool = False) -> torch.Tensor:
    """Rotated q ``[B, Hq, 1, D]`` of ``qkv * rstd(h) + bias``; k (rotated) and v written into the cache column
    ``cols`` (module docstring)."""
    args = (qkv, h, bias, cos, sin, key_layer, value_layer, cols)
    shape = dict(eps=eps, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    if rotary_problem(qkv, h, key_layer, value_layer, head_dim, interpret) is not None:
        return rotary_write_rms_reference(*args, **shape)
    return launch_or_fall_back(
        _FAILED, str(qkv.device), "RMS-scaled rotary/cache-write kernel",
        f"the PyTorch path runs instead on {qkv.device}", lambda: _launch_rotary(*args, **shape),
        lambda: rotary_write_rms_reference(*args, **shape))


def silu_mul_rms(gate_up, h, *, eps: float, interpret: bool = False, block: Optional[int] = None,
                 warps: Optional[int] = None) -> torch.Tensor:
    """``[B, I]``: ``silu(g * rstd(h)) * (u * rstd(h))`` of ``gate_up = [g | u]`` (module docstring). ``block``,
    ``warps``: the kernel's launch (columns per program, a power of two >= 16, and warps per program, a power of two
    <= 32); by default :func:`silu_block` and :func:`silu_warps` (``python -m benchmarks.decode_step --parts silu``
    times others)."""
    check_silu_launch(block, warps)
    if unsupported_reason(gate_up, h, interpret) is not None:
        return silu_mul_rms_reference(gate_up, h, eps=eps)
    return launch_or_fall_back(
        _FAILED, str(gate_up.device), "RMS-scaled SiLU-mul kernel", f"the PyTorch path runs instead on {gate_up.device}",
        lambda: _launch_silu(gate_up, h, eps, block, warps), lambda: silu_mul_rms_reference(gate_up, h, eps=eps))


def check_silu_launch(block: Optional[int], warps: Optional[int]) -> None:
    """``ValueError`` naming ``block`` or ``warps`` unless each is None or a launch :func:`silu_mul_rms` takes."""
    require(block is None or (is_int(block) and block >= 16 and block == pow2_at_least(block, 1)), "block",
            f"must be None or a power of two >= 16; got {block!r}")
    require(warps is None or (is_int(warps) and 1 <= warps <= 32 and warps == pow2_at_least(warps, 1)), "warps",
            f"must be None or a power of two in [1, 32]; got {warps!r}")


def silu_block(rows: int, inter: int, sms: int) -> int:
    """Columns per program of ``silu_mul_rms``: the largest power of two (at least 512, at most the row rounded up)
    that still gives each streaming multiprocessor about ``PROGRAMS_PER_SM`` programs."""
    blocks = max(1, -(-PROGRAMS_PER_SM * sms // max(rows, 1)))
    return max(512, min(pow2_at_least(inter, 1), pow2_at_least(-(-inter // blocks), 1)))


def silu_warps(block: int) -> int:
    """Warps per program of ``silu_mul_rms`` for ``block`` columns."""
    return 4 if block <= 1024 else 8


def _sms(device: torch.device) -> int:
    return sm_count(device.index or 0) if device.type == "cuda" else 1


def _launch_rotary(qkv, h, bias, cos, sin, key_layer, value_layer, cols, *, eps, heads, kv_heads, head_dim):
    from rollout.ops import rms_scaled_kernel as kernels

    batch, hidden = h.shape
    q = torch.empty(batch, heads, 1, head_dim, dtype=qkv.dtype, device=qkv.device)
    cos2, sin2 = cos.reshape(batch, head_dim), sin.reshape(batch, head_dim)
    kernels.rotary_write_rms[(batch,)](
        qkv, h, bias if bias is not None else qkv, cos2, sin2, q, key_layer, value_layer, cols, float(eps),
        qkv.stride(0), h.stride(0), cos2.stride(0), sin2.stride(0), key_layer.stride(0), key_layer.stride(1),
        key_layer.stride(2), value_layer.stride(0), value_layer.stride(1), value_layer.stride(2),
        HIDDEN=hidden, BLOCK_H=pow2_at_least(hidden, 1), HEADS=heads, KV_HEADS=kv_heads, DIM=head_dim,
        BLOCK_HEADS=pow2_at_least(heads + 2 * kv_heads, 1), HAS_BIAS=bias is not None, num_warps=4)
    return q


def _launch_silu(gate_up, h, eps, block=None, warps=None):
    from rollout.ops import rms_scaled_kernel as kernels

    batch, hidden = h.shape
    inter = gate_up.shape[1] // 2
    out = torch.empty(batch, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = int(block) if block else silu_block(batch, inter, _sms(gate_up.device))
    kernels.silu_mul_rms[(batch, -(-inter // block))](
        gate_up, h, out, float(eps), gate_up.stride(0), h.stride(0), out.stride(0), HIDDEN=hidden,
        BLOCK_H=pow2_at_least(hidden, 1), INTER=inter, BLOCK=block, num_warps=int(warps) if warps else silu_warps(block))
    return out

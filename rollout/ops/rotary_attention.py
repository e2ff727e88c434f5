"""A decode step's rotary, cache write and attention as one kernel a layer, in steps of at least
``RolloutConfig.kernels.rotary_in_attention_rows`` rows.

With the input norms folded into the q|k|v copies (``kernels.fold_norms``), a layer's decode attention takes the
product of the raw residual rows and runs, per layer, :func:`rollout.ops.rms_scaled.rotary_write_rms` (1/RMS, bias,
rotary of q and k, k and v written into the cache column) and then :func:`rollout.ops.decode_attention.attention`.
``rotary_attention`` gives the same result from the attention kernel alone: each of its programs (a row, a KV head, a
share of the key window) computes the rotated queries of its KV head from the product (a few KB, from L2), and the one
program whose share holds the step's column writes that head's k and v there before it reads its tiles. The
rotary kernel's launch (one a layer, ~2-4 us with its gap in the 3B step) goes.

The arithmetic is the rotary kernel's (``rms_scaled_kernel.scaled_rotated``: fp32, rounded once to the cache's dtype),
so the queries, the cache column and the output are those of the two kernels. Where the attention kernel cannot take
the inputs (:func:`rollout.ops.decode_attention.unsupported_reason`, the rotary kernel's rules of
:func:`rollout.ops.rms_scaled.rotary_problem`) or a prompt is read in a pass of its own (``SharedPrefix`` without
``first_row``), the two functions run one after the other; a fused kernel that fails to compile or launch warns once
and leaves the two to every later call on that device.
"""

from __future__ import annotations

from typing import Optional

import torch

from rollout.ops import decode_attention as da
from rollout.ops.fallback import launch_or_fall_back
from rollout.ops.rms_scaled import rotary_problem, rotary_write_rms

_FAILED: dict = {}
"""device -> why the fused kernel failed there."""


def failure(device: torch.device) -> Optional[str]:
    return _FAILED.get(str(device))


def unsupported_reason(qkv, h, key_layer, value_layer, keep, *, heads: int, head_dim: int, start: int, stop: int,
                       shared: Optional[da.SharedPrefix] = None, interpret: bool = False) -> Optional[str]:
    """None when :func:`rotary_attention` runs the fused kernel on these inputs; else why the two kernels run."""
    problem = rotary_problem(qkv, h, key_layer, value_layer, head_dim, interpret)
    if problem is not None:
        return problem
    if qkv.dtype != key_layer.dtype:
        return f"product dtype {qkv.dtype} is not the cache's {key_layer.dtype}"
    if da.shares_prefix(shared, heads, key_layer.shape[1]) and not shared.first_row:
        return "the prompts are read in a pass of their own"
    q = _queries(qkv, heads, head_dim)
    problem = da.unsupported_reason(q, key_layer[:, :, start:stop], value_layer[:, :, start:stop], keep, interpret)
    return problem or _FAILED.get(str(qkv.device))


def rotary_attention(qkv, h, bias, cos, sin, key_layer, value_layer, cols, *, keep, scale: float, eps: float,
                     heads: int, kv_heads: int, head_dim: int, start: int, stop: int,
                     last: Optional[torch.Tensor] = None, shared: Optional[da.SharedPrefix] = None,
                     splits: Optional[int] = None, interpret: bool = False) -> torch.Tensor:
    """Decode attention ``[B, Hq, 1, D]`` of the rows' rotated queries of ``qkv * rstd(h) + bias`` against the layer's
    cache columns ``[start, stop)`` (``keep [B, 1, 1, stop - start]``), after k (rotated) and v are written into
    cache column ``cols``: :func:`rollout.ops.rms_scaled.rotary_write_rms` then
    :func:`rollout.ops.decode_attention.attention` (module docstring). ``last``, ``shared``, ``splits`` and
    ``interpret``: as :func:`~rollout.ops.decode_attention.attention` takes them."""
    k, v = key_layer[:, :, start:stop], value_layer[:, :, start:stop]

    def apart():
        q = rotary_write_rms(qkv, h, bias, cos, sin, key_layer, value_layer, cols, eps=eps, heads=heads,
                             kv_heads=kv_heads, head_dim=head_dim, interpret=interpret)
        return da.attention(q, k, v, keep, scale, heads != kv_heads, splits=splits, interpret=interpret, last=last,
                            shared=shared)

    if unsupported_reason(qkv, h, key_layer, value_layer, keep, heads=heads, head_dim=head_dim, start=start,
                          stop=stop, shared=shared, interpret=interpret) is not None:
        return apart()
    batch = qkv.shape[0]
    rotary = da.RotaryInputs(h, bias, cos.reshape(batch, head_dim), sin.reshape(batch, head_dim), cols, start, eps)
    return launch_or_fall_back(
        _FAILED, str(qkv.device), "decode attention kernel with the rotary inside",
        f"the rotary kernel and the attention kernel run apart on {qkv.device}",
        lambda: da.launch(_queries(qkv, heads, head_dim), k, v, keep, scale, splits=splits, last=last,
                          shared=shared, rotary=rotary), apart)


def _queries(qkv: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """``[B, Hq, 1, D]``: the q columns of the product, as a view (the kernel reads the product's rows through it)."""
    return qkv[:, :heads * head_dim].view(qkv.shape[0], heads, 1, head_dim)

"""The folded norms' SiLU·mul kernel alone (``rollout.ops.rms_scaled.silu_mul_rms``): its default launch against
other launches, the same arithmetic compiled by inductor, and the unfolded step's SiLU·mul (no RMS), each over
``layers`` distinct inputs in one CUDA graph, as a step reads them (one launch's latency and L2 reuse do not
count)."""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.harness.cli import int_tuple
from benchmarks.harness.device import graph_ms
from rollout.model.step import compile_piece
from rollout.ops import rms_scaled
from rollout.ops.decode_attention import sm_count

EPS = 1e-6


def parse_launch(text: str) -> tuple[int, int]:
    """An argparse ``type`` for ``--silu-launches``: ``"block,warps"``, a launch
    :func:`rollout.ops.rms_scaled.check_silu_launch` accepts."""
    block, warps = int_tuple(2)(text)
    try:
        rms_scaled.check_silu_launch(block, warps)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc}; got {text!r}") from None
    return block, warps


def _silu_mul(gate_up):
    g, u = gate_up.chunk(2, dim=-1)
    return F.silu(g) * u


def silu_variants(rows: int, hidden: int, inter: int, layers: int, launches, device: str = "cuda") -> list[dict]:
    """``silu_mul_rms`` at ``rows`` rows: the default launch (:func:`rollout.ops.rms_scaled.silu_block`,
    :func:`~rollout.ops.rms_scaled.silu_warps`), each ``(block, warps)`` of ``launches``, the PyTorch reference
    compiled as the step's pieces are, and the unfolded step's compiled SiLU·mul (it reads no residual row): ms for
    ``layers`` layers, GB/s of the bytes each must move (the product read, the output written, the residual row read
    once) and the max |diff| against the reference. ``device``: ``"cuda"`` (the tests run the table's plumbing on
    the CPU, with the PyTorch path in place of the kernel and a stand-in for the graph timer)."""
    gate_ups = [torch.randn(rows, 2 * inter, device=device, dtype=torch.bfloat16) * 40 for _ in range(layers)]
    hs = [torch.randn(rows, hidden, device=device, dtype=torch.bfloat16) * 3 for _ in range(layers)]
    reference = rms_scaled.silu_mul_rms_reference(gate_ups[0], hs[0], eps=EPS).float()
    gbytes = layers * rows * (3 * inter + hidden) * 2 / 1e9
    block = rms_scaled.silu_block(rows, inter, sm_count(0) if device == "cuda" else 1)
    compiled = compile_piece(lambda g, h: rms_scaled.silu_mul_rms_reference(g, h, eps=EPS))
    unfolded = compile_piece(_silu_mul)

    def kernel(launch_block=None, launch_warps=None):
        return lambda g, h: rms_scaled.silu_mul_rms(g, h, eps=EPS, block=launch_block, warps=launch_warps)

    cases = [(f"kernel, default launch (block {block}, warps {rms_scaled.silu_warps(block)})", kernel(), True),
             *((f"kernel, block {b}, warps {w}", kernel(b, w), True) for b, w in launches),
             ("PyTorch reference, compiled (inductor)", compiled, True),
             ("unfolded step's SiLU·mul, compiled (no RMS: other arithmetic)", lambda g, h: unfolded(g), False)]
    out = []
    for name, fn, comparable in cases:  # comparable: the reference's arithmetic, so its |diff| is reported
        try:
            same = f", max |diff| {float((fn(gate_ups[0], hs[0]).float() - reference).abs().max()):.3g}" \
                if comparable else ""
            ms = graph_ms(lambda fn=fn: [fn(g, h) for g, h in zip(gate_ups, hs)], 20)
            out.append(dict(rows=rows, part=f"silu_mul_rms x{layers}", ms=ms,
                            variant=f"{name}: {gbytes / ms * 1e3:.0f} GB/s{same}"))
        except Exception as exc:  # noqa: BLE001 - a launch the compiler refuses is reported, not fatal
            out.append(dict(rows=rows, part=f"silu_mul_rms x{layers}", variant=name, ms=f"failed: {exc!r:.120}"))
    return out

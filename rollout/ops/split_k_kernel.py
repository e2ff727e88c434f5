"""The Triton kernel of :mod:`rollout.ops.split_k` (imported only where it runs: this module imports triton)."""

import triton
import triton.language as tl


@triton.jit
def add_partials(out_ptr, part_ptr, numel, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    # out[i] = out[i] + part[0, i] + ... + part[SPLITS - 1, i], in fp32 (the partials' own), rounded once into out's
    # dtype: the split-K GEMM's reduction and its residual add in one pass over the partials.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    total = tl.load(out_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    for s in tl.static_range(SPLITS):
        total += tl.load(part_ptr + s * numel + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=ok)

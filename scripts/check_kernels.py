#!/usr/bin/env python
"""Compile every Triton kernel of ``rollout/ops`` for a GPU on a machine that has none.

Triton's CPU interpreter (what the tests run without CUDA) accepts code that the GPU compiler rejects
(types it would not unify, shapes, unsupported constructs), so a kernel changed and tested on the CPU can
still fail to compile on the GPU, where the op then falls back to its PyTorch path with a warning: slower,
not wrong, and easy to miss. This script calls the ops' own launchers on CPU tensors with the kernels'
launch replaced: each launch's arguments become a Triton signature (tensors as typed pointers, Python ints
as i32/i64, floats as fp32, constexprs with their values, ``num_warps``/``num_stages`` as options) and the
kernel is compiled for ``--arch`` (default 90: the H100/H200) through PTX to a cubin with the ptxas that
ships with Triton. Nothing is launched and no GPU is needed. Choices the launchers make from the device
are made as on CUDA (``rollout.ops.dot_options``; the samplers' arities are each tried).

Each variant also reports what a launch would ask of the GPU, read from the cubin (the bundled ``cuobjdump``):
registers per thread, local memory (spills) and shared memory, and fails where a launch could not start
(``MAX_SHARED_BYTES`` of the architecture, 64K registers per block); spills are shown, not failed.

The cases cover each kernel's variants that the routes launch (dtypes, head sizes, a split or single key
window, with or without ``last``, a shared prompt with or without ``last``, the skinny linear's fused
forms, the nucleus kernels' arities, temperature scaling and log-probabilities). Prints one line per
compiled variant; exit 1 when any failed or a kernel of ``ENTRY_KERNELS`` was never compiled.

  python scripts/check_kernels.py [--arch 90 80] [--json FILE]

Run it with ``TRITON_INTERPRET`` unset (the script refuses otherwise: interpreted kernels cannot be compiled).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

ENTRY_KERNELS = {
    "rollout.ops.decode_attention_kernel": ("decode_attention_split", "decode_attention_shared",
                                            "decode_attention_merge"),
    "rollout.ops.skinny_linear_kernel": ("skinny_linear",),
    "rollout.ops.rotary_write_kernel": ("rotary_write",),
    "rollout.ops.rms_scaled_kernel": ("rotary_write_rms", "silu_mul_rms"),
    "rollout.ops.jsd_kernel": ("jsd_rows",),
    "rollout.ops.nucleus_kernel": ("nucleus_sample",),
    "rollout.ops.nucleus_split_kernel": ("chunk_stats", "search_pass", "tie_members", "draw", "finish", "draw_all"),
}
"""The kernels the ops launch (the other ``@triton.jit`` functions of these modules are helpers they call)."""

LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")

MAX_SHARED_BYTES = {80: 166_912, 86: 101_376, 89: 101_376, 90: 232_448}
"""Shared memory one block may use (the opt-in maximum) by compute capability x10 (CUDA's programming guide)."""
REGISTERS_PER_BLOCK = 65_536


@dataclass(frozen=True)
class Compiled:
    """One kernel variant compiled (or not) for one architecture."""

    kernel: str
    case: str
    arch: int
    constexprs: str
    options: str
    ok: bool
    error: Optional[str]
    seconds: float
    registers: Optional[int] = None
    """Per thread."""
    local_bytes: Optional[int] = None
    """Local memory per thread (register spills)."""
    shared_bytes: Optional[int] = None


def tensor_type(dtype) -> str:
    import torch

    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64",
             torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
             torch.bool: "i1"}
    if dtype not in names:
        raise TypeError(f"no Triton pointer type for {dtype}")
    return "*" + names[dtype]


def value_type(value) -> str:
    """The Triton type of a runtime (non-constexpr) argument, as the launcher would derive it."""
    import torch

    if isinstance(value, torch.Tensor):
        return tensor_type(value.dtype)
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__} {value!r}")


def signature_of(fn, args: tuple, kwargs: dict) -> tuple[dict, dict, dict]:
    """``(signature, constexprs, options)`` of a launch of the ``@triton.jit`` function ``fn``."""
    options = {k: v for k, v in kwargs.items() if k in LAUNCH_OPTIONS}
    bound = inspect.signature(fn.fn).bind(*args, **{k: v for k, v in kwargs.items() if k not in LAUNCH_OPTIONS})
    bound.apply_defaults()
    constexpr_names = {p.name for p in fn.params if p.is_constexpr}
    signature, constexprs = {}, {}
    for name, value in bound.arguments.items():
        if name in constexpr_names or value is None:
            signature[name], constexprs[name] = "constexpr", value
        else:
            signature[name] = value_type(value)
    return signature, constexprs, options


def cubin_usage(cubin: bytes) -> dict:
    """``{"registers", "local_bytes", "static_shared"}`` of a one-kernel cubin, from the ``cuobjdump`` that ships
    with Triton (``--dump-resource-usage``)."""
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        out = subprocess.run([tool, "--dump-resource-usage", handle.name], capture_output=True, text=True,
                             check=True).stdout
    return parse_usage(out)


def parse_usage(text: str) -> dict:
    """The first kernel's ``REG``, ``LOCAL`` and ``SHARED`` from ``cuobjdump --dump-resource-usage`` output."""
    import re

    found = re.search(r"REG:(\d+) STACK:\d+ SHARED:(\d+) LOCAL:(\d+)", text)
    if found is None:
        raise ValueError(f"no resource usage in cuobjdump's output: {text[:300]!r}")
    return {"registers": int(found.group(1)), "static_shared": int(found.group(2)), "local_bytes": int(found.group(3))}


def launch_problem(arch: int, registers: int, shared: int, num_warps: int) -> Optional[str]:
    """Why a launch of this kernel could not start on that architecture, or None."""
    limit = MAX_SHARED_BYTES.get(arch)
    if limit is not None and shared > limit:
        return f"needs {shared:,} bytes of shared memory, sm_{arch} allows {limit:,} per block"
    if registers * 32 * num_warps > REGISTERS_PER_BLOCK:
        return (f"needs {registers} registers x {32 * num_warps} threads = {registers * 32 * num_warps:,} per block, "
                f"more than {REGISTERS_PER_BLOCK:,}")
    return None


class Compiler:
    """Stands in for ``JITFunction.run``: compiles each new variant for every architecture, launches nothing."""

    def __init__(self, archs: list[int]):
        self.archs = archs
        self.case = ""
        self.results: list[Compiled] = []
        self._seen: set = set()

    def run(self, fn, *args, grid, warmup, **kwargs):
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        signature, constexprs, options = signature_of(fn, args, kwargs)
        name = f"{fn.fn.__module__}.{fn.fn.__name__}"
        for arch in self.archs:
            key = (name, arch, tuple(signature.items()), tuple(sorted(map(repr, constexprs.items()))),
                   tuple(sorted(options.items())))
            if key in self._seen:
                continue
            self._seen.add(key)
            start, error, usage = time.perf_counter(), None, {}
            try:
                compiled = triton.compile(ASTSource(fn, signature, constexprs=constexprs),
                                          target=GPUTarget("cuda", arch, 32), options=options)
                found = cubin_usage(compiled.asm["cubin"])
                usage = dict(registers=found["registers"], local_bytes=found["local_bytes"],
                             shared_bytes=compiled.metadata.shared + found["static_shared"])
                error = launch_problem(arch, usage["registers"], usage["shared_bytes"], compiled.metadata.num_warps)
            except Exception as exc:  # noqa: BLE001 - reported per variant, the run goes on
                error = f"{type(exc).__name__}: {exc}"
            shown = ", ".join(f"{k}={v!r}" for k, v in constexprs.items() if k.isupper())
            self.results.append(Compiled(name, self.case, arch, shown, ", ".join(f"{k}={v}" for k, v in
                                                                                options.items()),
                                         error is None, error, time.perf_counter() - start, **usage))
        return None


def attention_cases() -> list[tuple[str, Callable]]:
    import torch

    from rollout.ops import decode_attention as da

    def call(dtype, heads, kv_heads, dim, *, rows=8, length=1024, splits=None, last=False, samples=0, first_row=False):
        q = torch.zeros(rows, heads, 1, dim, dtype=dtype)
        k = torch.zeros(rows, kv_heads, length, dim, dtype=dtype)
        keep = torch.ones(rows, 1, 1, length, dtype=torch.bool)
        shared = None
        if samples:
            shared = da.SharedPrefix(torch.arange(rows, dtype=torch.long), samples, torch.tensor(length // 2), first_row)
        da.attention(q, k, k.clone(), keep, dim ** -0.5, heads != kv_heads, splits=splits, interpret=True,
                     last=torch.tensor(length - 1) if last else None, shared=shared)

    def fused(dtype, heads, kv_heads, dim, *, rows=8, length=1024, splits=None, bias=True, first_row=False):
        from rollout.ops import rotary_attention as ra

        qkv = torch.zeros(rows, (heads + 2 * kv_heads) * dim, dtype=dtype)
        cos = torch.ones(rows, 1, dim, dtype=dtype)
        cache = torch.zeros(rows, kv_heads, length, dim, dtype=dtype)
        shared = da.SharedPrefix(torch.arange(rows, dtype=torch.long), 4, torch.tensor(length // 2), True)
        keep = torch.ones(rows, 1, 1, length, dtype=torch.bool)
        ra.rotary_attention(qkv, torch.ones(rows, 2048, dtype=dtype), qkv[0] if bias else None, cos, cos.clone(),
                            cache, cache.clone(), torch.tensor([length - 1]), keep=keep, scale=dim ** -0.5, eps=1e-6,
                            heads=heads, kv_heads=kv_heads, head_dim=dim, start=0, stop=length, splits=splits,
                            shared=shared if first_row else None, interpret=True)

    bf16, fp32 = torch.bfloat16, torch.float32
    return [
        ("attention 3B bf16, rotary inside, bias, split", lambda: fused(bf16, 16, 2, 128, splits=4)),
        ("attention 3B bf16, rotary inside, one program", lambda: fused(bf16, 16, 2, 128, splits=1, bias=False)),
        ("attention 3B bf16, rotary inside, prompt from the first row", lambda: fused(bf16, 16, 2, 128, splits=2,
                                                                                     first_row=True)),
        ("attention fp32, rotary inside", lambda: fused(fp32, 4, 2, 64, splits=2)),
        ("attention 3B bf16, split", lambda: call(bf16, 16, 2, 128, splits=4)),
        ("attention 3B bf16, one program", lambda: call(bf16, 16, 2, 128, splits=1)),
        ("attention 3B bf16, split, last", lambda: call(bf16, 16, 2, 128, splits=4, last=True)),
        ("attention 7B bf16 (group 7), split", lambda: call(bf16, 28, 4, 128, splits=4)),
        ("attention fp32 head 64", lambda: call(fp32, 4, 2, 64, splits=2)),
        ("attention fp16 head 80 (padded)", lambda: call(torch.float16, 4, 4, 80, splits=2)),
        ("attention shared prompt", lambda: call(bf16, 16, 2, 128, splits=2, samples=4)),
        ("attention shared prompt, last", lambda: call(bf16, 16, 2, 128, splits=2, samples=4, last=True)),
        ("attention prompt from the first row, one program, last",
         lambda: call(bf16, 16, 2, 128, splits=1, samples=4, last=True, first_row=True)),
        ("attention prompt from the first row, split", lambda: call(bf16, 16, 2, 128, splits=2, samples=4,
                                                                    first_row=True)),
    ]


def linear_cases() -> list[tuple[str, Callable]]:
    import torch

    from rollout.ops import skinny_linear as sl

    def call(dtype=torch.bfloat16, *, rows=8, n=256, k=512, bias=False, norm=False, residual=False, glu=False,
             block_m=None):
        x = torch.zeros(rows, k, dtype=dtype)
        weight = torch.zeros(2 * n if glu else n, k, dtype=dtype)
        sl.skinny_linear(x, weight, torch.zeros(weight.shape[0], dtype=dtype) if bias else None,
                         torch.ones(k, dtype=dtype) if norm else None, 1e-6,
                         torch.zeros(rows, n, dtype=dtype) if residual else None, glu, interpret=True,
                         block_m=block_m)

    return [
        ("skinny linear, RMSNorm first + SiLU gate", lambda: call(norm=True, glu=True)),
        ("skinny linear, residual", lambda: call(residual=True)),
        ("skinny linear, bias, K not a block multiple", lambda: call(bias=True, k=520)),
        ("skinny linear, rows tiled", lambda: call(rows=64, block_m=32, norm=True)),
        ("skinny linear fp32", lambda: call(dtype=torch.float32)),
    ]


def rotary_cases() -> list[tuple[str, Callable]]:
    import torch

    from rollout.ops import rotary_write as rw

    def call(dtype, heads, kv_heads, dim, batch=8, length=64):
        qkv = torch.zeros(batch, (heads + 2 * kv_heads) * dim, dtype=dtype)
        cos = torch.ones(batch, 1, dim, dtype=dtype)
        cache = torch.zeros(batch, kv_heads, length, dim, dtype=dtype)
        rw.rotary_write(qkv, cos, cos.clone(), cache, cache.clone(), torch.zeros(batch, dtype=torch.long),
                        heads=heads, kv_heads=kv_heads, head_dim=dim, interpret=True)

    return [("rotary + cache write bf16", lambda: call(torch.bfloat16, 16, 2, 128)),
            ("rotary + cache write fp32", lambda: call(torch.float32, 4, 2, 64))]


def rms_scaled_cases() -> list[tuple[str, Callable]]:
    import torch

    from rollout.ops import rms_scaled as rs

    def rotary(dtype, heads, kv_heads, dim, hidden, bias, batch=8, length=64):
        qkv = torch.zeros(batch, (heads + 2 * kv_heads) * dim, dtype=dtype)
        h = torch.ones(batch, hidden, dtype=dtype)
        cos = torch.ones(batch, 1, dim, dtype=dtype)
        cache = torch.zeros(batch, kv_heads, length, dim, dtype=dtype)
        rs.rotary_write_rms(qkv, h, qkv[0] if bias else None, cos, cos.clone(), cache, cache.clone(),
                            torch.zeros(batch, dtype=torch.long), eps=1e-6, heads=heads, kv_heads=kv_heads,
                            head_dim=dim, interpret=True)

    def silu(dtype, rows, inter, hidden):
        sms, rs._sms = rs._sms, lambda device: 132  # the H200's count: the blocks a CUDA call would take
        try:
            rs.silu_mul_rms(torch.zeros(rows, 2 * inter, dtype=dtype), torch.ones(rows, hidden, dtype=dtype),
                            eps=1e-6, interpret=True)
        finally:
            rs._sms = sms

    return [("RMS-scaled rotary + cache write bf16, bias", lambda: rotary(torch.bfloat16, 16, 2, 128, 2048, True)),
            ("RMS-scaled rotary + cache write fp32", lambda: rotary(torch.float32, 4, 2, 64, 200, False)),
            ("RMS-scaled SiLU-mul bf16, 256 rows (4096 columns a program)",
             lambda: silu(torch.bfloat16, 256, 11008, 2048)),
            ("RMS-scaled SiLU-mul bf16, 8 rows (512 columns a program)", lambda: silu(torch.bfloat16, 8, 11008, 2048)),
            ("RMS-scaled SiLU-mul fp32", lambda: silu(torch.float32, 4, 1000, 300))]


def loss_cases() -> list[tuple[str, Callable]]:
    import torch

    from rollout.ops import jsd

    def call(dtype, beta, write_grad=True):
        student = torch.zeros(4, 1000, dtype=dtype)
        jsd.jsd_rows(student, student.clone(), beta, 0.7, 0.01, write_grad=write_grad, interpret=True,
                     fallback=lambda: None)

    return [(f"JSD rows {name} {str(dtype)[6:]}{'' if grad else ', loss only'}", lambda d=dtype, b=beta, g=grad: call(d, b, g))
            for name, beta in (("forward KL", 0.0), ("reverse KL", 1.0), ("beta 0.5", 0.5))
            for dtype in (torch.bfloat16, torch.float32) for grad in (True, False)]


def sampler_cases() -> list[tuple[str, Callable]]:
    import torch

    from rollout.ops import fused_nucleus as fn

    def call(arity, chunk_tokens, dtype=torch.bfloat16, temperature=1.0, logprobs=False, rows=4, vocab=151936,
             step_per_row=False):
        fn.arity = lambda rows, device: arity
        fn.split_arity = lambda rows, chunks, device: arity
        logits = torch.zeros(rows, vocab, dtype=dtype)
        step = torch.zeros(rows if step_per_row else (), dtype=torch.long)
        fn.sample_top_p(logits, temperature, 0.9, torch.tensor(7), torch.arange(rows), step, logprobs,
                        chunk_tokens=chunk_tokens)

    cases = []
    for arity in (fn.ARITY, fn.WIDE_ARITY):
        cases.append((f"nucleus, a program per row, arity {arity}", lambda a=arity: call(a, 0)))
    cases.append(("nucleus, a program per row, fp32, T=0.7, log-probs", lambda: call(fn.ARITY, 0, torch.float32,
                                                                                    0.7, True, step_per_row=True)))
    for arity in (fn.SPLIT_ARITY, fn.SPLIT_WIDE_ARITY, fn.SPLIT_WIDEST_ARITY):
        cases.append((f"nucleus, chunked, arity {arity}", lambda a=arity: call(a, None)))
    cases.append(("nucleus, chunked, fp16, T=0.7, log-probs", lambda: call(fn.SPLIT_ARITY, None, torch.float16, 0.7,
                                                                           True, step_per_row=True)))

    def plain(chunk_tokens, dtype=torch.bfloat16, temperature=1.0, logprobs=False, rows=4, vocab=151936):
        fn.sample_plain(torch.zeros(rows, vocab, dtype=dtype), temperature, torch.tensor(7), torch.arange(rows),
                        torch.zeros((), dtype=torch.long), logprobs, chunk_tokens=chunk_tokens)

    cases.append(("plain sampling (top-p 1), chunked", lambda: plain(None)))
    cases.append(("plain sampling, chunked, fp32, T=0.7, log-probs", lambda: plain(None, torch.float32, 0.7, True)))
    cases.append(("plain sampling, a program per row, log-probs", lambda: plain(0, logprobs=True)))
    return cases


def run_cases(compiler: Compiler, cases) -> None:
    from rollout.ops import decode_attention, fused_nucleus, skinny_linear
    from rollout.ops.dot_options import dot_options

    decode_attention.dot_options = skinny_linear.dot_options = lambda dtype, on_cuda: dot_options(dtype, True)
    arity, split_arity = fused_nucleus.arity, fused_nucleus.split_arity
    try:
        for name, case in cases:
            compiler.case = name
            case()
    finally:
        decode_attention.dot_options = skinny_linear.dot_options = dot_options
        fused_nucleus.arity, fused_nucleus.split_arity = arity, split_arity


def missing_kernels(results: list[Compiled]) -> list[str]:
    """Entry kernels that no case compiled."""
    compiled = {r.kernel for r in results}
    return [f"{module}.{name}" for module, names in ENTRY_KERNELS.items() for name in names
            if f"{module}.{name}" not in compiled]


def main(argv=None) -> int:
    from benchmarks.harness.cli import int_at_least, out_path

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int_at_least(70), nargs="+", default=[90],
                        help="CUDA compute capabilities x10 (70 and up; ASCII digits)")
    parser.add_argument("--json", metavar="FILE", type=out_path, help="write every variant's record here")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        parser.error("TRITON_INTERPRET is set: interpreted kernels cannot be compiled; unset it")
    import triton
    from triton.runtime.jit import JITFunction

    compiler = Compiler(args.arch)
    original = JITFunction.run
    JITFunction.run = lambda fn, *a, grid, warmup, **kw: compiler.run(fn, *a, grid=grid, warmup=warmup, **kw)
    try:
        run_cases(compiler, attention_cases() + linear_cases() + rotary_cases() + rms_scaled_cases() + loss_cases()
                  + sampler_cases())
    finally:
        JITFunction.run = original
    print(f"triton {triton.__version__}, target cuda sm_{'/'.join(map(str, args.arch))}")
    print(f"{'':6} {'kernel':24} {'arch':5} {'regs':>4} {'spill B':>7} {'smem KiB':>8} {'compile':>7}  case  [constexprs]")
    for r in compiler.results:
        status = "ok" if r.ok else "FAILED"
        usage = (f"{r.registers:4d} {r.local_bytes:7d} {r.shared_bytes / 1024:8.1f}" if r.registers is not None
                 else f"{'-':>4} {'-':>7} {'-':>8}")
        print(f"{status:6} {r.kernel.rsplit('.', 1)[1]:24} sm_{r.arch} {usage} {r.seconds:6.1f}s  {r.case}  "
              f"[{r.constexprs}]" + ("" if r.ok else f"\n       {r.error[:2000]}"))
    missing = missing_kernels(compiler.results)
    failed = [r for r in compiler.results if not r.ok]
    print(f"{len(compiler.results) - len(failed)} compiled, {len(failed)} failed"
          + (f"; never launched by a case: {', '.join(missing)}" if missing else ""))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"triton": triton.__version__, "missing": missing,
                       "variants": [asdict(r) for r in compiler.results]}, handle, indent=1)
    return 1 if failed or missing else 0


if __name__ == "__main__":
    sys.exit(main())

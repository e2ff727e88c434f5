#!/usr/bin/env python
"""Where a wide decode step's time goes (3B shape, bf16, H200): attention variants, the sampler, GEMMs.

Each variant is captured in a CUDA graph and replayed (no launch gaps), median of ``--iters`` replays
timed with CUDA events. Prints one table; ``--json`` writes the rows.

  python scripts/profile_decode_step.py --rows 256 --live 512
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
import os

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rollout.config import BLAS_LIBRARIES, RolloutConfig, SamplingConfig  # noqa: E402
from rollout.model.step import (FusedGateUp, FusedQKV, StepFns, StepParts, compiled_step_fns,  # noqa: E402
                                decode_logits, attention_inputs_qkv_write, compile_piece, grouped_decode_attention,
                                spec_and_weights)
from rollout.executors import blas  # noqa: E402
from rollout.executors.graphs import capture_graph  # noqa: E402
from rollout.ops import decode_attention, rotary_write, skinny_linear  # noqa: E402
from rollout.ops.sampling import select_next_token  # noqa: E402
from rollout.testing import shaped_model  # noqa: E402


def capture(fn) -> "torch.cuda.CUDAGraph":
    """``fn`` captured in a CUDA graph after two warm-up runs (the executors' own capture)."""
    return capture_graph(fn, [], torch.cuda.graph_pool_handle())


def graph_ms(fn, iters: int) -> float:
    """Median ms of one replay of ``fn`` captured in a CUDA graph (after two warm-up runs)."""
    graph = capture(fn)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def compiled_grouped_attention():
    """``rollout.model.step.grouped_decode_attention`` compiled as the step's pieces are."""
    return compile_piece(grouped_decode_attention)


def attention_variants(rows: int, live: int, heads: int, kv_heads: int, dim: int, layers: int):
    """One layer's decode attention per variant, times ``layers``."""
    q = torch.randn(rows, heads, 1, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(rows, kv_heads, live, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    keep = torch.rand(rows, 1, 1, live, device="cuda") > 0.1
    keep[..., -1] = True
    group = heads // kv_heads

    def gqa_mask():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)

    def grouped_mask():  # the query heads of one KV head as queries: K/V read once, no repeat
        qg = q.view(rows, kv_heads, group, dim)
        return F.scaled_dot_product_attention(qg, k, v, attn_mask=keep)

    bias = torch.zeros(rows, 1, 1, live, device="cuda", dtype=torch.bfloat16).masked_fill(~keep, float("-inf"))

    def grouped_bias():
        qg = q.view(rows, kv_heads, group, dim)
        return F.scaled_dot_product_attention(qg, k, v, attn_mask=bias)

    def grouped_nomask():  # lower bound: no mask at all (flash)
        qg = q.view(rows, kv_heads, group, dim)
        return F.scaled_dot_product_attention(qg, k, v)

    compiled_grouped = compiled_grouped_attention()

    def grouped_bmm():  # two batched GEMMs per KV head, mask + softmax fused by inductor
        return compiled_grouped(q, k, v, keep, dim ** -0.5, True)

    def triton_kernel(splits=None, block=decode_attention.BLOCK_L, warps=decode_attention.WARPS,
                      stages=decode_attention.STAGES, mask=None):
        mask = keep if mask is None else mask
        return lambda: decode_attention.attention(q, k, v, mask, dim ** -0.5, True, splits=splits, block=block,
                                                  warps=warps, stages=stages)

    padded = keep.clone()
    padded[::2, ..., : live // 2] = False  # every other row: half its window is left padding

    def sdpa_padded():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=padded, enable_gqa=True)

    launch = [(f"triton kernel, block {b_} warps {w} stages {st}", triton_kernel(block=b_, warps=w, stages=st))
              for b_, w, st in ((64, 4, 3), (64, 4, 1), (32, 4, 2), (128, 4, 2), (64, 8, 2), (32, 2, 2))]

    auto = decode_attention.split_count(rows, kv_heads, live, decode_attention.sm_count(0))
    out = {}
    for name, fn in (("sdpa gqa + bool mask (now)", gqa_mask), ("grouped q + bool mask", grouped_mask),
                     ("grouped q + bf16 bias", grouped_bias), ("grouped q, no mask", grouped_nomask),
                     ("grouped bmm, compiled", grouped_bmm),
                     (f"triton kernel, splits auto ({auto})", triton_kernel()),
                     *((f"triton kernel, {n} splits", triton_kernel(n)) for n in (1, 2, 4, 8) if n != auto),
                     *launch, ("sdpa gqa, half the rows half padded", sdpa_padded),
                     ("triton kernel, half the rows half padded", triton_kernel(mask=padded))):
        try:
            out[name] = graph_ms(fn, 20) * layers
        except Exception as exc:  # noqa: BLE001 - a variant the backend refuses is reported, not fatal
            out[name] = f"failed: {exc!r:.120}"
    diff = (decode_attention.attention(q, k, v, keep, dim ** -0.5, True).float() - gqa_mask().float()).abs().max()
    print(f"# {rows} rows: triton kernel vs SDPA, max |diff| {diff.item():.3g}", flush=True)
    kv_bytes = 2 * rows * kv_heads * live * dim * 2 * layers
    return out, kv_bytes


def shared_prefix_variants(rows: int, live: int, prefix: int, filled: int, samples: int, heads: int, kv_heads: int,
                           dim: int, layers: int) -> list[dict]:
    """The Triton attention over a batch whose rows are ``samples`` copies of each prompt (``prefix`` columns,
    identical within a prompt's rows) followed by their own columns up to ``filled``, in a length bucket of
    ``live`` columns: the whole bucket read (before ``last``), up to the last filled column (``last``), and
    each prompt read once for its samples (``shared``), times ``layers``; with the bytes each reads."""
    q = torch.randn(rows, heads, 1, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(rows, kv_heads, live, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    k[:, :, :prefix] = k[::samples, :, :prefix].repeat_interleave(samples, 0)[:rows]
    v[:, :, :prefix] = v[::samples, :, :prefix].repeat_interleave(samples, 0)[:rows]
    keep = torch.zeros(rows, 1, 1, live, dtype=torch.bool, device="cuda")
    keep[..., :filled] = True
    last = torch.tensor(filled - 1, device="cuda")
    shared = decode_attention.SharedPrefix(torch.arange(rows, device="cuda"), samples,
                                           torch.tensor(prefix, device="cuda"))
    scale = dim ** -0.5
    column = 2 * kv_heads * dim * 2 * layers  # bytes of one row's column, keys and values, every layer
    groups = -(-rows // samples)
    cases = [("whole length bucket", lambda: decode_attention.attention(q, k, v, keep, scale, True), rows * live),
             ("to the last column (last)", lambda: decode_attention.attention(q, k, v, keep, scale, True, last=last),
              rows * filled),
             (f"last + each prompt once for its {samples} samples (shared)",
              lambda: decode_attention.attention(q, k, v, keep, scale, True, last=last, shared=shared),
              groups * prefix + rows * (filled - prefix))]
    reference = cases[0][1]().float()
    out = []
    for name, fn, columns in cases:
        err = float((fn().float() - reference).abs().max())
        try:
            ms = graph_ms(fn, 20) * layers
            gbs = columns * column / ms / 1e6
            out.append(dict(rows=rows, part=f"attention x{layers}, prefix {prefix}, filled {filled}, bucket {live}",
                            variant=f"{name}: {columns * column / 1e9:.2f} GB, {gbs:.0f} GB/s, max |diff| {err:.3g}",
                            ms=ms))
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            out.append(dict(rows=rows, part="attention shared", variant=name, ms=f"failed: {exc!r:.120}"))
    return out


def sampler_variants(rows: int, vocab: int):
    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16) * 3
    seed = torch.zeros((), dtype=torch.long, device="cuda")
    ids = torch.arange(rows, device="cuda")
    step = torch.ones((), dtype=torch.long, device="cuda")
    greedy = SamplingConfig(max_new_tokens=8, temperature=0.0)
    sampled = SamplingConfig(max_new_tokens=8, temperature=1.0, top_p=0.9)
    plain = SamplingConfig(max_new_tokens=8, temperature=1.0)
    compiled = torch.compile(select_next_token, fullgraph=True, dynamic=False)
    out = {}
    for name, fn, s in (("greedy (eager)", select_next_token, greedy), ("T=1 (eager)", select_next_token, plain),
                        ("T=1 top-p 0.9 (eager, now)", select_next_token, sampled),
                        ("T=1 (compiled)", compiled, plain), ("T=1 top-p 0.9 (compiled)", compiled, sampled)):
        try:
            out[name] = graph_ms(lambda fn=fn, s=s: fn(logits, s, None, seed, ids, step), 20)
        except Exception as exc:  # noqa: BLE001
            out[name] = f"failed: {exc!r:.120}"
    return out


@dataclasses.dataclass(frozen=True)
class StepVariant:
    """One way to run the decode step (:func:`decode_step_fn`)."""

    compiled: bool = True
    fuse_qkv: bool = True
    mode: str | None = None
    """The ``torch.compile`` mode of the compiled pieces (``RolloutConfig.kernels.compile_mode``)."""
    additive_mask: bool = False
    """SDPA gets an additive bf16 mask built once, instead of the boolean ``keep`` that torch converts at
    every layer's call under the cuDNN backend (the experiment of BENCHMARKS' leads)."""
    grouped: bool = False
    """The batched-GEMM attention ``grouped_decode_attention``, compiled with the step."""
    kv_write: bool = False
    """k and v written into the cache inside the fused q|k|v piece (``attention_inputs_qkv_write``)."""
    triton_attention: bool = False
    """Attention by the Triton kernel (``rollout.ops.decode_attention``) instead of SDPA."""
    gate_up: bool = False
    """gate and up as one GEMM over their concatenated weight (``RolloutConfig.kernels.fuse_gate_up``)."""
    rotary_kernel: bool = False
    """q/k rotary and the k/v cache writes as one Triton kernel (``RolloutConfig.kernels.rotary_kernel``)."""
    skinny: bool = False
    """Each layer's o projection and residual add as one Triton kernel at batches up to the default
    ``RolloutConfig.kernels.skinny_rows`` (with the rotary kernel)."""

    @property
    def name(self) -> str:
        return (("compiled" if self.compiled else "eager") + (" + fused q|k|v" if self.fuse_qkv else "")
                + (f", mode {self.mode}" if self.mode else "") + (", additive mask" if self.additive_mask else "")
                + (", grouped bmm attention" if self.grouped else "")
                + (", k/v written in the piece" if self.kv_write else "")
                + (", triton attention" if self.triton_attention else "")
                + (", fused gate|up" if self.gate_up else "")
                + (", rotary+write kernel" if self.rotary_kernel else "")
                + (", skinny o projection" if self.skinny else ""))


#: The step the routes run by default (``RolloutConfig``: compiled, fused q|k|v and gate|up, the Triton attention,
#: the rotary + cache-write kernel, the o projection on the skinny kernel at small batches): what ``--kernels``
#: lists.
ROUTE_DEFAULT = StepVariant(kv_write=True, triton_attention=True, gate_up=True, rotary_kernel=True, skinny=True)


def decode_step_fn(model, rows: int, live: int, variant: StepVariant):
    """One decode step of ``rows`` rows over ``live`` cached columns (random cache), as a closure."""
    spec, weights = spec_and_weights(model)
    if variant.fuse_qkv:
        weights = FusedQKV().refresh(weights)
    if variant.gate_up:
        weights = FusedGateUp().refresh(weights)
    fns = compiled_step_fns(variant.mode) if variant.compiled else StepFns()
    if variant.grouped:
        fns = dataclasses.replace(fns, attention=compiled_grouped_attention() if variant.compiled
                                  else grouped_decode_attention)
    if variant.kv_write:
        fns = dataclasses.replace(fns, attention_inputs_qkv_write=compile_piece(attention_inputs_qkv_write, variant.mode)
                                  if variant.compiled else attention_inputs_qkv_write)
    if variant.triton_attention:
        fns = dataclasses.replace(fns, attention=decode_attention.attention)
    if variant.rotary_kernel or variant.skinny:
        fns = dataclasses.replace(fns, rotary_write=rotary_write.rotary_write)
    if variant.skinny:
        fns = dataclasses.replace(fns, skinny_linear=skinny_linear.skinny_linear, skinny_rows=RolloutConfig().kernels.skinny_rows)
    parts = StepParts(spec, weights, fns)
    shape = (spec.num_layers, rows, spec.num_kv_heads, live + 8, spec.head_dim)
    keys = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    values = torch.randn_like(keys)
    tokens = torch.randint(3, 1000, (rows,), device="cuda")
    positions = torch.full((rows,), live, device="cuda")
    col = torch.tensor(live, device="cuda")
    keep = torch.ones(rows, 1, 1, live + 1, dtype=torch.bool, device="cuda")
    if variant.additive_mask:  # what torch's cuDNN path builds from the boolean mask: 0 kept, -65504 elsewhere
        keep = torch.zeros(keep.shape, dtype=torch.bfloat16, device="cuda").masked_fill_(~keep, -65504.0)
    return lambda: decode_logits(parts, keys, values, tokens, positions, col, keep)


def prefill_variants(model, rows: int, lengths: list[int], max_tokens: int, rounds: int = 10) -> list[dict]:
    """The packed prefill of ``rows`` prompts of each length (all real tokens, the routes' default pieces), run
    eagerly and from a CUDA graph (``RolloutConfig.kernels.prefill_graph_tokens``): median wall ms of one pass, host
    included (synchronized before and after), ``rounds`` interleaved rounds after two warm-up passes each (the
    graph's first pass captures), and the max |diff| of their logits."""
    from rollout import Rollout
    from rollout.executors.prefill_graph import PrefillGraphs
    from rollout.model.prefill import prefill_logits
    from rollout.plan.layout import RowSpans
    from rollout.testing import TinyTokenizer

    parts = Rollout(model, TinyTokenizer(), RolloutConfig())._fast_step.parts(torch.device("cuda"), mirrored=True)
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    out = []
    for length in lengths:
        ids = torch.randint(3, 1000, (rows, length), device="cuda")
        mask = torch.ones_like(ids)
        spans = RowSpans((length,) * rows, (0,) * rows)
        shape = (cfg.num_hidden_layers, rows, cfg.num_key_value_heads, length + 8, head_dim)
        keys = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
        values = torch.zeros_like(keys)
        graphs = PrefillGraphs(max_tokens)
        fns = {"eager": lambda: prefill_logits(parts, keys, values, ids, mask, rows=spans),
               "graph": lambda: prefill_logits(parts, keys, values, ids, mask, rows=spans, graphs=graphs)}
        results = {name: [fn(), fn()][-1] for name, fn in fns.items()}
        diff = (results["eager"].float() - results["graph"].float()).abs().max().item()
        times = {name: [] for name in fns}
        for _ in range(rounds):
            for name, fn in fns.items():
                torch.cuda.synchronize()
                start = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                times[name].append(1e3 * (time.perf_counter() - start))
        note = (f"replays {graphs.replays}, captures {graphs.graphs.num_captures}"
                + (f", failed: {graphs.failure}" if graphs.failure else ""))
        for name, ms in times.items():
            variant = name if name == "eager" else f"graph ({note}; max |logit diff| {diff:.3g})"
            out.append(dict(rows=rows, part=f"prefill {rows} x {length} tokens", variant=variant,
                            ms=statistics.median(ms)))
    return out


def step_variants(model, rows: int, live: int, variant: StepVariant):
    return graph_ms(decode_step_fn(model, rows, live, variant), 10)


def blas_backend(name):
    """``rollout.executors.blas.blas_library`` on this GPU: the routes' way of running a block on one BLAS backend
    (``None``: leave the process's), the previous one restored after. A CUDA graph keeps the GEMM kernels chosen
    while it was captured."""
    return blas.blas_library(name, torch.device("cuda"))


def blas_ab(model, rows: int, live: int, backends: list[str]) -> list[dict]:
    """The routes' default step captured and timed under each BLAS backend, the backends alternating twice."""
    out = []
    for name in backends * 2:
        with blas_backend(name):
            ms = step_variants(model, rows, live, ROUTE_DEFAULT)
        out.append(dict(rows=rows, part="decode_logits", variant=f"{ROUTE_DEFAULT.name}; BLAS {name}", ms=ms))
    return out


#: The A/B flags (``--gate-up``, ...): each times only the routes' default step against the same with one
#: ``StepVariant`` field flipped, twice each, alternating, the variant with the field off first.
ROUTE_AB = {"gate_up": "gate|up as one GEMM", "rotary_kernel": "the rotary+write kernel",
            "skinny": "the skinny o projection"}


def step_variant_list(args) -> list[StepVariant]:
    """The step variants the flags ask for: eager, compiled, compiled + fused q|k|v, then the experiments."""
    for field in ROUTE_AB:  # an A/B alone, interleaved
        if getattr(args, field):
            flipped = dataclasses.replace(ROUTE_DEFAULT, **{field: not getattr(ROUTE_DEFAULT, field)})
            return [flipped, ROUTE_DEFAULT] * 2 if getattr(ROUTE_DEFAULT, field) else [ROUTE_DEFAULT, flipped] * 2
    out = [StepVariant(compiled=False, fuse_qkv=False), StepVariant(fuse_qkv=False), StepVariant()]
    out += [StepVariant(additive_mask=True)] if args.additive_mask else []
    out += [StepVariant(grouped=True)] if args.grouped_attention else []
    out += [StepVariant(kv_write=True)] if args.kv_write_in_piece else []
    out += [StepVariant(additive_mask=True, kv_write=True)] if args.additive_mask and args.kv_write_in_piece else []
    out += [StepVariant(triton_attention=True)] if args.triton_attention else []
    out += [StepVariant(triton_attention=True, kv_write=True)] if args.triton_attention and args.kv_write_in_piece else []
    out += [StepVariant(triton_attention=True, kv_write=True, mode=m) for m in args.compile_modes
            if args.triton_attention and args.kv_write_in_piece]
    return out + [StepVariant(mode=m) for m in args.compile_modes]


def gemm_variants(rows: int, hidden: int, inter: int, q_dim: int, kv_dim: int, layers: int):
    """A layer's projections at ``rows`` rows, separate weights (what runs) against concatenated ones
    (q|k|v and gate|up as one GEMM each), ``layers`` distinct weights in one CUDA graph (as a step reads them:
    one launch's latency and L2 reuse do not count); ms of all layers and the bf16 GEMM rate each reaches.
    (Before e9a2ce2 this table timed one GEMM per replay and multiplied by ``layers``: the small-N GEMMs' figures
    were mostly a graph launch's latency.)"""
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    h = torch.randn(rows, inter, device="cuda", dtype=torch.bfloat16)
    w = {name: [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(layers)]
         for name, n, k in (("q", q_dim, hidden), ("k", kv_dim, hidden), ("v", kv_dim, hidden), ("o", hidden, q_dim),
                            ("gate", inter, hidden), ("up", inter, hidden), ("down", hidden, inter))}
    qkv = [torch.cat(parts) for parts in zip(w["q"], w["k"], w["v"])]
    gate_up = [torch.cat(parts) for parts in zip(w["gate"], w["up"])]
    flops = {"qkv": 2 * rows * hidden * (q_dim + 2 * kv_dim), "o": 2 * rows * q_dim * hidden,
             "gate_up": 2 * rows * hidden * 2 * inter, "down": 2 * rows * inter * hidden}

    def each(fn, *weights):
        return lambda: [fn(*ws) for ws in zip(*weights)]

    cases = {
        "q, k, v separate (now)": ("qkv", each(lambda q, k, v: (F.linear(x, q), F.linear(x, k), F.linear(x, v)),
                                               w["q"], w["k"], w["v"])),
        "qkv concatenated": ("qkv", each(lambda wt: F.linear(x, wt), qkv)),
        "o": ("o", each(lambda wt: F.linear(x, wt), w["o"])),
        "gate, up separate (now)": ("gate_up", each(lambda g, u: (F.linear(x, g), F.linear(x, u)), w["gate"], w["up"])),
        "gate|up concatenated": ("gate_up", each(lambda wt: F.linear(x, wt), gate_up)),
        "down": ("down", each(lambda wt: F.linear(h, wt), w["down"])),
    }
    out = {}
    for name, (kind, fn) in cases.items():
        ms = graph_ms(fn, 20)
        out[name] = (ms, layers * flops[kind] / (ms / 1000) / 1e12)
    return out


def skinny_variants(rows: int, hidden: int, inter: int, qkv_dim: int, layers: int, launches) -> list[dict]:
    """Each projection of a layer in its fused form (q|k|v with the norm and bias, o with the residual, gate|up
    with the norm and SiLU·mul, down with the residual), ``layers`` distinct weights in one CUDA graph (as the
    step reads them: nothing from L2), through the compiled pieces' way (``torch.compile`` around cuBLAS)
    against ``skinny_linear`` at each launch shape ``(block_n, block_k, warps, stages)``, or ``(block_m, block_n,
    block_k, warps, stages)`` with the rows in tiles of ``block_m`` (0: one tile): ms, GB/s of weights read and the
    bf16 rate."""
    from rollout.model.step import compile_piece, rms_norm

    def bf16(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * shape[-1] ** -0.5

    x_h, x_i = bf16(rows, hidden), bf16(rows, inter)
    norm, bias = torch.rand(hidden, device="cuda", dtype=torch.bfloat16) + 0.5, bf16(qkv_dim)
    forms = {  # name: (weight shape, skinny kwargs, compiled baseline of one layer)
        "q|k|v + norm + bias": ((qkv_dim, hidden), lambda w: dict(x=x_h, weight=w, bias=bias, norm=norm, eps=1e-6),
                                compile_piece(lambda x, w, b, n: F.linear(rms_norm(x, n, 1e-6), w, b))),
        "o + residual": ((hidden, hidden), lambda w: dict(x=x_h, weight=w, residual=x_h),
                         compile_piece(lambda x, w, r: r + F.linear(x, w))),
        "gate|up + norm + silu*mul": ((2 * inter, hidden), lambda w: dict(x=x_h, weight=w, norm=norm, eps=1e-6, glu=True),
                                      compile_piece(lambda x, w, n: (lambda g, u: F.silu(g) * u)(
                                          *F.linear(rms_norm(x, n, 1e-6), w).chunk(2, dim=-1)))),
        "down + residual": ((hidden, inter), lambda w: dict(x=x_i, weight=w, residual=x_h),
                            compile_piece(lambda x, w, r: r + F.linear(x, w))),
    }
    out = []
    for name, (shape, kwargs_of, baseline) in forms.items():
        weights = [bf16(*shape) for _ in range(layers)]
        gbytes = layers * shape[0] * shape[1] * 2 / 1e9
        ref = skinny_linear.skinny_linear_reference(**kwargs_of(weights[0]))

        def compiled(weights=weights, kwargs_of=kwargs_of, baseline=baseline):
            for w in weights:
                kw = kwargs_of(w)
                args = [kw["x"], w] + [kw[k] for k in ("bias", "norm", "residual") if k in kw]
                baseline(*args)

        cases = [("compiled pieces (cuBLAS)", compiled)]
        for launch in launches:
            bm, (bn, bk, warps, stages) = (launch[0] or None, launch[1:]) if len(launch) == 5 else (None, launch)
            if bm is None and rows > skinny_linear.MAX_ROWS:
                continue  # one tile cannot hold the rows
            shape = dict(block_m=bm, block_n=bn, block_k=bk, warps=warps, stages=stages)

            def run(weights=weights, kwargs_of=kwargs_of, shape=shape):
                for w in weights:
                    skinny_linear.skinny_linear(**kwargs_of(w), **shape)
            got = skinny_linear.skinny_linear(**kwargs_of(weights[0]), **shape)
            err = float((got.float() - ref.float()).abs().max())
            tiles = f"block_m {bm}, " if bm else ""
            cases.append((f"skinny {tiles}block_n {bn}, block_k {bk}, warps {warps}, stages {stages} "
                          f"(max |diff| {err:.3g})", run))
        for label, fn in cases:
            try:
                ms = graph_ms(fn, 10)
                tflops = 2 * rows * gbytes / 2 / ms  # 2 * rows * (weights' elements) FLOP over ms: TFLOP/s
                out.append(dict(rows=rows, part=f"{name} x{layers}",
                                variant=f"{label}, {gbytes / ms * 1e3:.0f} GB/s, {tflops:.0f} TFLOP/s", ms=ms))
            except Exception as exc:  # noqa: BLE001 - a launch shape that fails is reported, not fatal
                out.append(dict(rows=rows, part=f"{name} x{layers}", variant=label, ms=f"failed: {exc!r:.120}"))
    return out


def step_kernels(model, rows: int, live: int, iters: int = 5, variant: StepVariant = StepVariant()) -> str:
    """Kernels of the compiled decode step (one CUDA graph, ``iters`` replays under torch.profiler), by
    total device time."""
    from torch.profiler import ProfilerActivity, profile

    graph = capture(decode_step_fn(model, rows, live, variant))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            graph.replay()
        torch.cuda.synchronize()
    return (f"## kernels of {iters} replays of the decode step ({variant.name}), {rows} rows, {live} live columns\n"
            + prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=90))


def profile_call(model, prompts: int, samples: int, prompt_len: int, new: int, temperature: float) -> str:
    """Top kernels (by total device time) of one ``generate`` call after a warm-up (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    from rollout import Rollout, RolloutConfig, RolloutRequest
    from rollout.testing import TinyTokenizer

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100000, (prompts, prompt_len), generator=gen).cuda()
    mask = torch.ones_like(ids)
    sampling = SamplingConfig(max_new_tokens=new, temperature=temperature, top_p=0.9 if temperature > 0 else 1.0,
                              n_samples_per_prompt=samples, seed=1)
    ro = Rollout(model, TinyTokenizer(pad_token_id=0, eos_token_id=None), RolloutConfig())
    ro.generate(RolloutRequest(ids, mask), sampling)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        ro.generate(RolloutRequest(ids, mask), sampling)
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--live", type=int, default=512)
    parser.add_argument("--json")
    parser.add_argument("--profile-call", action="store_true", help="also profile one 64x4 x 256+256 sampled call")
    parser.add_argument("--kernels", action="store_true", help="also the kernels of the routes' default step and GEMM variants")
    parser.add_argument("--compile-modes", nargs="+", default=[],
                        choices=["max-autotune-no-cudagraphs"],
                        help="step: also the compiled + fused q|k|v step under these torch.compile modes")
    parser.add_argument("--additive-mask", action="store_true",
                        help="step: also the compiled + fused q|k|v step with an additive mask built once")
    parser.add_argument("--kv-write-in-piece", action="store_true",
                        help="step: also the compiled + fused q|k|v step that writes k/v inside the compiled piece")
    parser.add_argument("--grouped-attention", action="store_true",
                        help="step: also the compiled + fused q|k|v step with the batched-GEMM attention")
    parser.add_argument("--triton-attention", action="store_true",
                        help="step: also the compiled + fused q|k|v step with the Triton decode attention")
    for field, what in ROUTE_AB.items():
        parser.add_argument("--" + field.replace("_", "-"), action="store_true",
                            help=f"step: only the routes' default step and the same with or without {what}, twice "
                                 "each, alternating")
    parser.add_argument("--skinny-launches", nargs="+", default=["16,256,4,4", "16,512,4,3", "16,128,4,6", "16,256,2,4",
                                                                 "32,128,4,4", "32,256,8,3"],
                        help="--parts skinny: launch shapes block_n,block_k,warps,stages, or "
                             "block_m,block_n,block_k,warps,stages with the rows in tiles of block_m "
                             "(wide batches: --rows 128 256)")
    parser.add_argument("--kernel-variant", choices=["default", "no-skinny"], default="default",
                        help="--kernels: list the kernels of the routes' default step, or of it without the skinny "
                             "o projection")
    parser.add_argument("--parts", nargs="+", default=["attention", "sampler", "step"],
                        choices=["attention", "sampler", "step", "skinny", "prefill", "shared"],
                        help="which tables to time")
    parser.add_argument("--shared-windows", type=lambda s: tuple(int(v) for v in s.split(",")), nargs="+",
                        default=[(256, 384), (256, 300), (768, 820)],
                        help="--parts shared: prefix,filled column counts (within --live)")
    parser.add_argument("--samples", type=int, default=4, help="--parts shared: rows per prompt")
    parser.add_argument("--blas", nargs="+", default=[], choices=BLAS_LIBRARIES,
                        help="step: only the routes' default step under each of these BLAS backends "
                             "(torch.backends.cuda.preferred_blas_library), alternating twice; with --kernels the "
                             "GEMM table under each too")
    parser.add_argument("--prefill-lengths", nargs="+", type=int, default=[16, 64, 256],
                        help="--parts prefill: prompt lengths (every row all real tokens)")
    parser.add_argument("--prefill-graph-tokens", type=int, default=16384,
                        help="--parts prefill: RolloutConfig.kernels.prefill_graph_tokens of the graph variant")
    args = parser.parse_args(argv)
    model = shaped_model("qwen25-3b", dtype=torch.bfloat16, device="cuda")
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    rows_out = []
    kernel_tables = []
    for rows in args.rows:
        if "attention" in args.parts:
            att, kv_bytes = attention_variants(rows, args.live, cfg.num_attention_heads, cfg.num_key_value_heads,
                                               head_dim, cfg.num_hidden_layers)
            for name, ms in att.items():
                rows_out.append(dict(rows=rows, part="attention x36", variant=name, ms=ms, kv_gb=kv_bytes / 1e9))
        if "shared" in args.parts:
            for prefix, filled in args.shared_windows:
                rows_out += shared_prefix_variants(rows, args.live, prefix, filled, args.samples,
                                                   cfg.num_attention_heads, cfg.num_key_value_heads, head_dim,
                                                   cfg.num_hidden_layers)
        if "sampler" in args.parts:
            for name, ms in sampler_variants(rows, cfg.vocab_size).items():
                rows_out.append(dict(rows=rows, part="sampler", variant=name, ms=ms))
        if "skinny" in args.parts:
            launches = [tuple(int(v) for v in launch.split(",")) for launch in args.skinny_launches]
            rows_out += skinny_variants(rows, cfg.hidden_size, cfg.intermediate_size,
                                        (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * head_dim,
                                        cfg.num_hidden_layers, launches)
        if "prefill" in args.parts:
            rows_out += prefill_variants(model, rows, args.prefill_lengths, args.prefill_graph_tokens)
        if "step" in args.parts and args.blas:
            rows_out += blas_ab(model, rows, args.live, args.blas)
        elif "step" in args.parts:
            for variant in step_variant_list(args):
                try:
                    ms = step_variants(model, rows, args.live, variant)
                except Exception as exc:  # noqa: BLE001 - an experiment that fails is reported, not fatal
                    ms = f"failed: {exc!r:.120}"
                rows_out.append(dict(rows=rows, part="decode_logits", variant=variant.name, ms=ms))
        if args.kernels:
            kv_dim = cfg.num_key_value_heads * head_dim
            for backend in args.blas or [None]:
                with blas_backend(backend):
                    table = gemm_variants(rows, cfg.hidden_size, cfg.intermediate_size,
                                          cfg.num_attention_heads * head_dim, kv_dim, cfg.num_hidden_layers)
                suffix = f"; BLAS {backend}" if backend else ""
                for name, (ms, tflops) in table.items():
                    rows_out.append(dict(rows=rows, part="GEMM x36", variant=f"{name} ({tflops:.0f} TFLOP/s){suffix}",
                                         ms=ms))
            listed = ROUTE_DEFAULT if args.kernel_variant == "default" else dataclasses.replace(ROUTE_DEFAULT, skinny=False)
            kernel_tables.append(step_kernels(model, rows, args.live, variant=listed))
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}; live {args.live} columns")
    print("| rows | part | variant | ms |")
    print("|---:|---|---|---:|")
    for r in rows_out:
        ms = f"{r['ms']:.3f}" if isinstance(r["ms"], float) else r["ms"]
        print(f"| {r['rows']} | {r['part']} | {r['variant']} | {ms} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows_out, f, indent=1)
    for table in kernel_tables:
        print(table)
    if args.profile_call:
        for temperature in (1.0, 0.0):
            print(f"## one call: 64 prompts x 4, prompt 256, 256 new, temperature {temperature}")
            print(profile_call(model, 64, 4, 256, 256, temperature))


if __name__ == "__main__":
    main()

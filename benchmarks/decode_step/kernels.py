"""The decode step's matrix products (separate against concatenated weights, cuBLAS against the skinny Triton
kernel) and the packed prefill, eager against replayed from a CUDA graph."""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from benchmarks.harness.device import graph_ms
from benchmarks.harness.rounds import Rounds, Timer, time_rounds
from rollout.config import KernelConfig
from rollout.executors.decode import FastStep
from rollout.model.step import compile_piece, rms_norm
from rollout.ops import skinny_linear


def prefill_variants(model, rows: int, lengths: list[int], max_tokens: int, rounds: int = 10) -> list[dict]:
    """The packed prefill of ``rows`` prompts of each length (all real tokens, the routes' default pieces), run
    eagerly and from a CUDA graph (``RolloutConfig.kernels.prefill_graph_tokens``): median wall ms of one pass, host
    included (synchronized before and after), ``rounds`` interleaved rounds after two warm-up passes each (the
    graph's first pass captures), and the max |diff| of their logits."""
    from rollout.executors.prefill_graph import PrefillGraphs
    from rollout.model.prefill import prefill_logits
    from rollout.plan.layout import RowSpans

    parts = FastStep(model, KernelConfig(), mirror_weights=False).parts(torch.device("cuda"), mirrored=True)
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
        results = {name: [fn(), fn()][-1] for name, fn in fns.items()}  # the warm-up: two passes each
        diff = (results["eager"].float() - results["graph"].float()).abs().max().item()
        times = time_rounds(fns, Rounds(rounds, warmup=0), Timer("cuda"))
        note = (f"replays {graphs.replays}, captures {graphs.graphs.num_captures}"
                + (f", failed: {graphs.failure}" if graphs.failure else ""))
        for name, ms in times.items():
            variant = name if name == "eager" else f"graph ({note}; max |logit diff| {diff:.3g})"
            out.append(dict(rows=rows, part=f"prefill {rows} x {length} tokens", variant=variant,
                            ms=statistics.median(ms)))
    return out


def gemm_variants(rows: int, hidden: int, inter: int, q_dim: int, kv_dim: int, layers: int):
    """A layer's projections at ``rows`` rows, separate weights (what runs) against concatenated ones
    (q|k|v and gate|up as one GEMM each), ``layers`` distinct weights in one CUDA graph (as a step reads them:
    one launch's latency and L2 reuse do not count); ms of all layers and the bf16 GEMM rate each reaches.
    (Before e9a2ce2 this table timed one GEMM per replay and multiplied by ``layers``: the small-N GEMMs' figures
    were mostly a graph launch's latency.)"""
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    h = torch.randn(rows, inter, device="cuda", dtype=torch.bfloat16)
    r = torch.zeros(rows, hidden, device="cuda", dtype=torch.bfloat16)  # a residual the in-place forms add into
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
        # with the residual: out of place (torch copies the residual into the output, then the GEMM's beta-add) and
        # in place (kernels.residual_in_place)
        "o + residual (addmm)": ("o", each(lambda wt: torch.addmm(x, x, wt.t()), w["o"])),
        "o + residual in place (addmm_)": ("o", each(lambda wt: r.addmm_(x, wt.t()), w["o"])),
        "down + residual (addmm)": ("down", each(lambda wt: torch.addmm(x, h, wt.t()), w["down"])),
        "down + residual in place (addmm_)": ("down", each(lambda wt: r.addmm_(h, wt.t()), w["down"])),
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


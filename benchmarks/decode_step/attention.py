"""The decode step's attention and sampler pieces, alone: each variant captured in a CUDA graph and replayed."""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from benchmarks.harness.device import graph_ms
from rollout.config import SamplingConfig
from rollout.model.step import compile_piece, grouped_decode_attention
from rollout.ops import decode_attention
from rollout.ops.sampling import select_next_token
from rollout.plan.buckets import storage_columns


@dataclass(frozen=True)
class Geometry:
    """The attention's shape of the model (``--live`` columns cached)."""

    heads: int
    kv_heads: int
    head_dim: int
    layers: int

    @property
    def column_bytes(self) -> int:
        """Bytes of one row's cached column in bf16: its keys and values, every layer."""
        return 2 * self.kv_heads * self.head_dim * 2 * self.layers

    @classmethod
    def of(cls, config) -> "Geometry":
        heads = config.num_attention_heads
        return cls(heads, config.num_key_value_heads, config.hidden_size // heads, config.num_hidden_layers)


def stored_like(rows: int, kv_heads: int, live: int, dim: int) -> torch.Tensor:
    """Random bf16 keys or values ``[rows, kv_heads, live, dim]`` as the rollout stores them: a view of storage
    ``storage_columns`` wide (a new cache's width on CUDA), so the stride is the rollout's. Storage exactly ``live``
    wide reads 6-19% slower at some widths (1,280 and 2,560 columns on an H100: ``rollout.plan.buckets``)."""
    columns = storage_columns(live, dim * torch.bfloat16.itemsize)
    return torch.randn(rows, kv_heads, columns, dim, device="cuda", dtype=torch.bfloat16)[:, :, :live]


def compiled_grouped_attention():
    """``rollout.model.step.grouped_decode_attention`` compiled as the step's pieces are."""
    return compile_piece(grouped_decode_attention)


def attention_variants(rows: int, live: int, geo: Geometry) -> tuple[dict, int]:
    """One layer's decode attention per variant, times the layers: ``{name: ms or "failed: ..."}`` and the bytes of
    keys and values all layers read."""
    heads, kv_heads, dim = geo.heads, geo.kv_heads, geo.head_dim
    q = torch.randn(rows, heads, 1, dim, device="cuda", dtype=torch.bfloat16)  # q: [B, Hq, 1, D]
    k = stored_like(rows, kv_heads, live, dim)  # k: [B, Hkv, L, D]
    v = stored_like(rows, kv_heads, live, dim)
    keep = torch.rand(rows, 1, 1, live, device="cuda") > 0.1
    keep[..., -1] = True
    group = heads // kv_heads
    qg = q.view(rows, kv_heads, group, dim)  # the query heads of one KV head as queries: K/V read once, no repeat
    bias = torch.zeros(rows, 1, 1, live, device="cuda", dtype=torch.bfloat16).masked_fill(~keep, float("-inf"))
    compiled_grouped = compiled_grouped_attention()
    padded = keep.clone()
    padded[::2, ..., : live // 2] = False  # every other row: half its window is left padding

    def triton_kernel(splits=None, block=decode_attention.BLOCK_L, warps=decode_attention.WARPS,
                      stages=decode_attention.STAGES, mask=None):
        mask = keep if mask is None else mask
        return lambda: decode_attention.attention(q, k, v, mask, dim ** -0.5, True, splits=splits, block=block,
                                                  warps=warps, stages=stages)

    launch = [(f"triton kernel, block {b_} warps {w} stages {st}", triton_kernel(block=b_, warps=w, stages=st))
              for b_, w, st in ((64, 4, 3), (64, 4, 1), (32, 4, 2), (32, 4, 3), (32, 4, 4), (128, 4, 2), (64, 8, 2),
                                (64, 8, 3), (128, 8, 2), (32, 2, 2), (16, 4, 4))]
    launch += [(f"triton kernel, block {b_} warps {w} stages {st}, {n} splits", triton_kernel(n, b_, w, st))
               for b_, w, st, n in ((32, 4, 3, 2), (64, 4, 2, 3), (32, 4, 2, 2))]
    auto = decode_attention.split_count(rows, kv_heads, live, decode_attention.sm_count(0))
    gqa_mask = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)  # noqa: E731
    cases = (("sdpa gqa + bool mask (now)", gqa_mask),
             ("grouped q + bool mask", lambda: F.scaled_dot_product_attention(qg, k, v, attn_mask=keep)),
             ("grouped q + bf16 bias", lambda: F.scaled_dot_product_attention(qg, k, v, attn_mask=bias)),
             ("grouped q, no mask", lambda: F.scaled_dot_product_attention(qg, k, v)),  # lower bound: flash
             ("grouped bmm, compiled", lambda: compiled_grouped(q, k, v, keep, dim ** -0.5, True)),
             (f"triton kernel, splits auto ({auto})", triton_kernel()),
             *((f"triton kernel, {n} splits", triton_kernel(n)) for n in (1, 2, 4, 8) if n != auto),
             *launch,
             ("sdpa gqa, half the rows half padded",
              lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=padded, enable_gqa=True)),
             ("triton kernel, half the rows half padded", triton_kernel(mask=padded)))
    out = {}
    for name, fn in cases:
        try:
            out[name] = graph_ms(fn, 20) * geo.layers
        except Exception as exc:  # noqa: BLE001 - a variant the backend refuses is reported, not fatal
            out[name] = f"failed: {exc!r:.120}"
    diff = (decode_attention.attention(q, k, v, keep, dim ** -0.5, True).float() - gqa_mask().float()).abs().max()
    print(f"# {rows} rows: triton kernel vs SDPA, max |diff| {diff.item():.3g}", flush=True)
    return out, rows * live * geo.column_bytes


@dataclass(frozen=True)
class SharedWindow:
    """A batch whose rows are ``samples`` copies of each prompt: ``prefix`` shared columns, then each row's own up to
    ``filled``, in a length bucket of ``live`` columns."""

    live: int
    prefix: int
    filled: int
    samples: int


def shared_prefix_variants(rows: int, window: SharedWindow, geo: Geometry) -> list[dict]:
    """The Triton attention over a :class:`SharedWindow`: the whole bucket read, up to the last filled column
    (``last``), and each prompt read once for its samples (``shared``), times the layers; with the bytes each
    reads."""
    heads, kv_heads, dim, samples, prefix = geo.heads, geo.kv_heads, geo.head_dim, window.samples, window.prefix
    q = torch.randn(rows, heads, 1, dim, device="cuda", dtype=torch.bfloat16)
    k = stored_like(rows, kv_heads, window.live, dim)
    v = stored_like(rows, kv_heads, window.live, dim)
    k[:, :, :prefix] = k[::samples, :, :prefix].repeat_interleave(samples, 0)[:rows]
    v[:, :, :prefix] = v[::samples, :, :prefix].repeat_interleave(samples, 0)[:rows]
    keep = torch.zeros(rows, 1, 1, window.live, dtype=torch.bool, device="cuda")
    keep[..., :window.filled] = True
    last = torch.tensor(window.filled - 1, device="cuda")
    shared = decode_attention.SharedPrefix(torch.arange(rows, device="cuda"), samples,
                                           torch.tensor(prefix, device="cuda"))
    scale = dim ** -0.5
    column = geo.column_bytes
    groups = -(-rows // samples)
    cases = [("whole length bucket", lambda: decode_attention.attention(q, k, v, keep, scale, True),
              rows * window.live),
             ("to the last column (last)", lambda: decode_attention.attention(q, k, v, keep, scale, True, last=last),
              rows * window.filled),
             (f"last + each prompt once for its {samples} samples (shared)",
              lambda: decode_attention.attention(q, k, v, keep, scale, True, last=last, shared=shared),
              groups * prefix + rows * (window.filled - prefix))]
    cases += [(f"shared, {n} program(s) a prompt",
               lambda n=n: decode_attention.attention(q, k, v, keep, scale, True, last=last, shared=shared,
                                                      prefix_splits=n),
               groups * prefix + rows * (window.filled - prefix)) for n in (1, 2)]
    # each row reads the prompt's whole tiles from its run's first row (memory serves them once, L2 the rest)
    tiles = prefix // decode_attention.BLOCK_L * decode_attention.BLOCK_L
    first_row = dataclasses.replace(shared, first_row=True)
    cases.append((f"last + the prompt from each run's first row (shared first_row, {tiles} columns)",
                  lambda: decode_attention.attention(q, k, v, keep, scale, True, last=last, shared=first_row),
                  groups * tiles + rows * (window.filled - tiles)))
    reference = cases[0][1]().float()
    part = f"attention x{geo.layers}, prefix {prefix}, filled {window.filled}, bucket {window.live}"
    out = []
    for name, fn, columns in cases:
        err = float((fn().float() - reference).abs().max())
        try:
            ms = graph_ms(fn, 20) * geo.layers
            gbs = columns * column / ms / 1e6
            out.append(dict(rows=rows, part=part, ms=ms,
                            variant=f"{name}: {columns * column / 1e9:.2f} GB, {gbs:.0f} GB/s, max |diff| {err:.3g}"))
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            out.append(dict(rows=rows, part="attention shared", variant=name, ms=f"failed: {exc!r:.120}"))
    return out


def padding_variants(rows: int, live: int, geo: Geometry, rounds: int = 3) -> list[dict]:
    """The Triton attention over prompts of 128..256 tokens left-padded into 256 columns, then filled to ``live``
    columns (the ordinary route's opsd cells): each row's window from its first kept column (today) against from
    the tile edge before it (``align``, the kernel before 2026-12-07), times the layers, rounds alternating (A B,
    B A, ...), medians; with the columns each reads and the largest difference between them."""
    heads, kv_heads, dim = geo.heads, geo.kv_heads, geo.head_dim
    q = torch.randn(rows, heads, 1, dim, device="cuda", dtype=torch.bfloat16)
    k = stored_like(rows, kv_heads, live, dim)
    v = stored_like(rows, kv_heads, live, dim)
    gen = torch.Generator().manual_seed(0)
    first = 256 - torch.randint(128, 257, (rows,), generator=gen)  # each row's first kept column
    keep = (torch.arange(live)[None, :] >= first[:, None]).view(rows, 1, 1, live).cuda()
    last = torch.tensor(live - 1, device="cuda")
    block = decode_attention.BLOCK_L
    column = geo.column_bytes
    cases = {"from the first kept column (today)": (False, int((live - first).sum())),
             "from the tile edge before it (align)": (True, int((live - first // block * block).sum()))}
    fns = {name: (lambda a=align: decode_attention.attention(q, k, v, keep, dim ** -0.5, True, last=last, align=a))
           for name, (align, _) in cases.items()}
    err = float((fns["from the first kept column (today)"]().float()
                 - fns["from the tile edge before it (align)"]().float()).abs().max())
    times = {name: [] for name in cases}
    for r in range(rounds):
        for name in (list(cases) if r % 2 == 0 else list(cases)[::-1]):
            times[name].append(graph_ms(fns[name], 20) * geo.layers)
    part = f"attention x{geo.layers}, prompts 128..256 left-padded in 256, {live} columns; max |diff| {err:.3g}"
    return [dict(rows=rows, part=part, ms=statistics.median(times[name]),
                 variant=f"{name}: {columns * column / 1e9:.2f} GB, "
                         f"{columns * column / statistics.median(times[name]) / 1e6:.0f} GB/s")
            for name, (_, columns) in cases.items()]


def sampler_variants(rows: int, vocab: int) -> dict:
    """Token selection at ``rows`` rows, eager and compiled, greedy / T=1 / top-p (``benchmarks.sampler`` has the
    full comparison)."""
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

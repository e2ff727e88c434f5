"""Whole decode steps: variants of the step built from ``KernelConfig`` the way the routes build theirs
(``rollout.executors.decode.FastStep``), each captured in a CUDA graph; the BLAS A/B; the step's kernels."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from benchmarks.decode_step.attention import compiled_grouped_attention
from benchmarks.harness.device import capture, graph_ms, print_tuned_plans
from benchmarks.harness.rounds import Rounds, run_rounds
from rollout.cache.static import CacheShape
from rollout.config import TUNED_BLAS, KernelConfig, SamplingConfig
from rollout.executors import blas
from rollout.executors.decode import FastStep
from rollout.model.step import decode_logits, grouped_decode_attention

#: The step before the kernels of issue 15 (compiled pieces, fused q|k|v, SDPA attention): the base of the
#: experiments. ``KernelConfig()`` itself is the step the routes run by default.
BASE = KernelConfig(fused_kv_write=False, decode_attention="sdpa", fuse_gate_up=False, rotary_kernel=False,
                    skinny_rows=0, shared_prefix_rows=0)


@dataclass(frozen=True)
class StepVariant:
    """One way to run the decode step: the kernel settings the routes would run it with, and two experiments that
    are not settings."""

    kernels: KernelConfig = BASE
    additive_mask: bool = False
    """SDPA gets an additive bf16 mask built once, instead of the boolean ``keep`` that torch converts at every
    layer's call under the cuDNN backend."""
    grouped: bool = False
    """The batched-GEMM attention ``grouped_decode_attention`` (compiled with the step's pieces)."""

    @property
    def name(self) -> str:
        k = self.kernels
        return (("compiled" if k.compile else "eager") + (" + fused q|k|v" if k.fuse_qkv else "")
                + (f", mode {k.compile_mode}" if k.compile_mode else "")
                + (", additive mask" if self.additive_mask else "")
                + (", grouped bmm attention" if self.grouped else "")
                + (", k/v written in the piece" if k.fused_kv_write else "")
                + (", triton attention" if k.decode_attention == "triton" else "")
                + (", fused gate|up" if k.fuse_gate_up else "")
                + (", rotary+write kernel" if k.rotary_kernel else "")
                + (", skinny o projection" if k.skinny_rows else "")
                + (", o and down added in place" if k.residual_in_place else "")
                + (", norms folded" if k.fold_norms and (k.rotary_kernel or k.fuse_gate_up and k.residual_in_place)
                   else "")
                + (f", rotary in the attention from {k.rotary_in_attention_rows} rows" if k.rotary_in_attention_rows
                   and k.fold_norms and k.rotary_kernel and k.decode_attention == "triton" else ""))


def variant(additive_mask: bool = False, grouped: bool = False, **kernels) -> StepVariant:
    """A variant of :data:`BASE` with these kernel settings."""
    return StepVariant(dataclasses.replace(BASE, **kernels), additive_mask, grouped)


#: The step the routes run by default: what ``--kernels`` lists.
ROUTE_DEFAULT = StepVariant(KernelConfig())
#: The A/B flags (``--gate-up``, ...): each times only the routes' default step against the same with one setting
#: flipped (the setting -> its other value), twice each, alternating, the flipped variant first.
ROUTE_AB = {"gate_up": ("fuse_gate_up", False, "gate|up as one GEMM"),
            "rotary_kernel": ("rotary_kernel", False, "the rotary+write kernel"),
            "skinny": ("skinny_rows", 0, "the skinny o projection"),
            "residual_in_place": ("residual_in_place", False, "o and down added into the residual in place"),
            "fold_norms": ("fold_norms", False, "the norm gains folded into the fused copies, 1/RMS in the kernels"),
            "rotary_in_attention": ("rotary_in_attention_rows", 0, "the rotary and cache write inside the attention "
                                    f"kernel from {KernelConfig().rotary_in_attention_rows} rows")}


def decode_step_fn(model, rows: int, live: int, step: StepVariant, device: str = "cuda"):
    """One decode step of ``rows`` rows over ``live`` cached columns (random cache), as a closure."""
    parts = FastStep(model, step.kernels, mirror_weights=False).parts(torch.device(device), mirrored=False)
    if step.grouped:
        attention = compiled_grouped_attention() if step.kernels.compile and device == "cuda" else \
            grouped_decode_attention
        parts = dataclasses.replace(parts, fns=dataclasses.replace(parts.fns, attention=attention))
    spec, dtype = parts.spec, next(model.parameters()).dtype
    # keys, values: [layers, B, Hkv, live + 8, D], views of storage as wide as a new cache's (CacheShape.storage_columns)
    shape = CacheShape(rows, live + 8, spec.num_layers, spec.num_kv_heads, spec.head_dim, dtype, torch.device(device))
    keys, values = (torch.randn(shape.storage_dims, device=device, dtype=dtype)[:, :, :, :live + 8] for _ in range(2))
    tokens = torch.randint(3, min(1000, model.config.vocab_size), (rows,), device=device)
    positions = torch.full((rows,), live, device=device)
    col = torch.tensor(live, device=device)
    keep = torch.ones(rows, 1, 1, live + 1, dtype=torch.bool, device=device)
    if step.additive_mask:  # what torch's cuDNN path builds from the boolean mask: 0 kept, -65504 elsewhere
        keep = torch.zeros(keep.shape, dtype=dtype, device=device).masked_fill_(~keep, -65504.0)
    return lambda: decode_logits(parts, keys, values, tokens, positions, col, keep)


def step_ms(model, rows: int, live: int, step: StepVariant) -> float:
    return graph_ms(decode_step_fn(model, rows, live, step), 10)


def step_variant_list(args) -> tuple[list[StepVariant], int]:
    """The step variants the flags ask for and the rounds to time them in: eager, compiled, compiled + fused q|k|v,
    then the experiments, once; or one A/B of :data:`ROUTE_AB` alone, in two rounds (off, on, on, off)."""
    for flag, (setting, off, _) in ROUTE_AB.items():
        if getattr(args, flag):
            return [StepVariant(dataclasses.replace(ROUTE_DEFAULT.kernels, **{setting: off})), ROUTE_DEFAULT], 2
    out = [variant(compile=False, fuse_qkv=False), variant(fuse_qkv=False), variant()]
    out += [variant(additive_mask=True)] if args.additive_mask else []
    out += [variant(grouped=True)] if args.grouped_attention else []
    out += [variant(fused_kv_write=True)] if args.kv_write_in_piece else []
    out += [variant(additive_mask=True, fused_kv_write=True)] if args.additive_mask and args.kv_write_in_piece else []
    out += [variant(decode_attention="triton")] if args.triton_attention else []
    both = args.triton_attention and args.kv_write_in_piece
    out += [variant(decode_attention="triton", fused_kv_write=True)] if both else []
    out += [variant(decode_attention="triton", fused_kv_write=True, compile_mode=m) for m in args.compile_modes if both]
    return out + [variant(compile_mode=m) for m in args.compile_modes], 1


def time_steps(model, rows: int, live: int, steps: list[StepVariant], rounds: int) -> list[dict]:
    """A row per timed step, in the harness's rounds (no warm-up call: each timing captures its own graph after two
    warm-up runs); a step that fails is a row saying so."""
    out = []

    def call(step, seed, timed):
        try:
            ms = step_ms(model, rows, live, step)
        except Exception as exc:  # noqa: BLE001 - an experiment that fails is reported, not fatal
            ms = f"failed: {exc!r:.120}"
        out.append(dict(rows=rows, part="decode_logits", variant=step.name, ms=ms))

    run_rounds(steps, Rounds(rounds, warmup=0), call)
    return out


def blas_backend(name):
    """``rollout.executors.blas.blas_library`` on this GPU: the routes' way of running a block on one BLAS backend
    (``None``: leave the process's), the previous one restored after. A CUDA graph keeps the GEMM kernels chosen
    while it was captured."""
    return blas.blas_library(name, torch.device("cuda"))


def blas_ab(model, rows: int, live: int, backends: list[str]) -> list[dict]:
    """The routes' default step captured and timed under each BLAS backend, in two rounds (A B, B A); with
    ``"cublaslt-tuned"`` its projections on each shape's fastest cuBLASLt algorithm, as the routes run them."""
    out = []

    def call(name, seed, timed):
        with blas_backend(name):
            step = StepVariant(dataclasses.replace(ROUTE_DEFAULT.kernels, blas_library=name))
            ms = step_ms(model, rows, live, step)
        out.append(dict(rows=rows, part="decode_logits", variant=f"{ROUTE_DEFAULT.name}; BLAS {name}", ms=ms))

    run_rounds(backends, Rounds(2, warmup=0), call)
    if TUNED_BLAS in backends:
        print_tuned_plans()
    return out


def step_kernels(model, rows: int, live: int, step: StepVariant, iters: int = 5) -> str:
    """Kernels of the decode step (one CUDA graph, ``iters`` replays under torch.profiler), by total device time."""
    from torch.profiler import ProfilerActivity, profile

    graph = capture(decode_step_fn(model, rows, live, step))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            graph.replay()
        torch.cuda.synchronize()
    return (f"## kernels of {iters} replays of the decode step ({step.name}), {rows} rows, {live} live columns\n"
            + prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=90))


def profile_call(model, prompts: int, samples: int, lengths: tuple[int, int], temperature: float) -> str:
    """Top kernels (by total device time) of one ``generate`` call of ``prompts`` x ``samples`` rows, ``lengths`` =
    (prompt, new tokens), after a warm-up (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    from rollout import Rollout, RolloutConfig, RolloutRequest
    from rollout.testing import TinyTokenizer

    prompt_len, new = lengths
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

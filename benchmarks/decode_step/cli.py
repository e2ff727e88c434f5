"""``python -m benchmarks.decode_step``: the command line (see :mod:`benchmarks.decode_step`)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Optional, Union

import torch

from benchmarks.decode_step.attention import Geometry, SharedWindow, attention_variants, padding_variants, \
    sampler_variants, shared_prefix_variants
from benchmarks.decode_step.kernels import gemm_variants, prefill_variants, skinny_variants
from benchmarks.decode_step.norms import parse_launch, silu_variants
from benchmarks.decode_step.step import ROUTE_AB, StepVariant, blas_ab, blas_backend, profile_call, \
    step_kernels, step_variant_list, time_steps
from benchmarks.harness import results
from benchmarks.harness.cli import int_at_least, int_tuple, out_path
from benchmarks.harness.meta import header, run_meta
from benchmarks.harness.table import fmt, markdown_table
from rollout.config import BLAS_LIBRARIES, KernelConfig
from rollout.testing import shaped_model

PARTS = ("attention", "sampler", "step", "skinny", "prefill", "shared", "silu", "padding")
#: ``--kernel-variant``: the step whose kernels ``--kernels`` lists.
KERNEL_VARIANTS = {"default": KernelConfig(), "no-skinny": KernelConfig(skinny_rows=0),
                   "residual-copied": KernelConfig(residual_in_place=False), "norms-unfolded": KernelConfig(fold_norms=False),
                   "rotary-apart": KernelConfig(rotary_in_attention_rows=0),
                   "rotary-inside": KernelConfig(rotary_in_attention_rows=1)}


@dataclass
class StepRow:
    rows: int
    part: str
    variant: str
    ms: Union[float, str]
    """Median ms, or ``"failed: ..."``."""
    kv_gb: Optional[float] = None
    """Attention: GB of keys and values the layers read."""


def _skinny_launch(text: str) -> tuple:
    """An argparse ``type`` for ``--skinny-launches``: 4 ints >= 1, or 5 with a first (block_m) >= 0."""
    launch = int_tuple(4, 5, minimum=0)(text)
    if min(launch[-4:]) < 1:
        raise argparse.ArgumentTypeError(f"block_n, block_k, warps and stages must be >= 1; got {text!r}")
    return launch


def window_problem(args) -> Optional[str]:
    """Why ``--shared-windows`` cannot be timed at ``--live`` columns (checked before the model is built), or None."""
    bad = [f"{p},{f}" for p, f in args.shared_windows if not p < f <= args.live]
    if "shared" in args.parts and bad:
        return f"--shared-windows: each prefix,filled needs prefix < filled <= --live {args.live}; got {' '.join(bad)}"
    return None


def build_parser() -> argparse.ArgumentParser:
    from benchmarks import decode_step

    parser = argparse.ArgumentParser(prog="python -m benchmarks.decode_step", description=decode_step.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int_at_least(1), nargs="+", default=[32, 256])
    parser.add_argument("--live", type=int_at_least(1), default=512, help="cached columns each row attends")
    parser.add_argument("--json", type=out_path, help="write the result file here")
    parser.add_argument("--profile-call", action="store_true", help="also profile one 64x4 x 256+256 sampled call")
    parser.add_argument("--kernels", action="store_true",
                        help="also the kernels of the routes' default step and GEMM variants")
    parser.add_argument("--compile-modes", nargs="+", default=[], choices=["max-autotune-no-cudagraphs"],
                        help="step: also the compiled + fused q|k|v step under these torch.compile modes")
    parser.add_argument("--additive-mask", action="store_true",
                        help="step: also the compiled + fused q|k|v step with an additive mask built once")
    parser.add_argument("--kv-write-in-piece", action="store_true",
                        help="step: also the compiled + fused q|k|v step that writes k/v inside the compiled piece")
    parser.add_argument("--grouped-attention", action="store_true",
                        help="step: also the compiled + fused q|k|v step with the batched-GEMM attention")
    parser.add_argument("--triton-attention", action="store_true",
                        help="step: also the compiled + fused q|k|v step with the Triton decode attention")
    for flag, (setting, flipped, what) in ROUTE_AB.items():
        parser.add_argument("--" + flag.replace("_", "-"), action="store_true",
                            help=f"step: only the routes' default step and the same with kernels.{setting}="
                                 f"{flipped} ({what}), in two rounds")
    parser.add_argument("--skinny-launches", type=_skinny_launch, nargs="+",
                        default=[(16, 256, 4, 4), (16, 512, 4, 3), (16, 128, 4, 6), (16, 256, 2, 4), (32, 128, 4, 4),
                                 (32, 256, 8, 3)],
                        help="--parts skinny: launch shapes block_n,block_k,warps,stages, or "
                             "block_m,block_n,block_k,warps,stages with the rows in tiles of block_m "
                             "(wide batches: --rows 128 256)")
    parser.add_argument("--silu-launches", type=parse_launch, nargs="+",
                        default=[(512, 4), (1024, 4), (1024, 8), (2048, 4), (2048, 8), (4096, 4), (4096, 8),
                                 (4096, 16), (8192, 8), (8192, 16)],
                        help="--parts silu: launches block,warps of the folded norms' SiLU·mul kernel besides its "
                             "default (block: columns per program, a power of two >= 16; warps: a power of two <= 32)")
    parser.add_argument("--kernel-variant", choices=sorted(KERNEL_VARIANTS), default="default",
                        help="--kernels: list the kernels of the routes' default step, or of it without the skinny "
                             "o projection, or with the residual copied before o and down are added "
                             "(kernels.residual_in_place=False), or with the norms run apart (kernels.fold_norms=False), "
                             "or with the rotary kernel before the attention at every row count "
                             "(kernels.rotary_in_attention_rows=0) or inside it at every row count (=1)")
    parser.add_argument("--parts", nargs="+", default=["attention", "sampler", "step"], choices=PARTS,
                        help="which tables to time")
    parser.add_argument("--shared-windows", type=int_tuple(2), nargs="+",
                        default=[(256, 384), (256, 300), (768, 820)],
                        help="--parts shared: prefix,filled column counts (within --live)")
    parser.add_argument("--samples", type=int_at_least(1), default=4, help="--parts shared: rows per prompt")
    parser.add_argument("--blas", nargs="+", default=[], choices=BLAS_LIBRARIES,
                        help="step: only the routes' default step under each of these BLAS backends "
                             "(torch.backends.cuda.preferred_blas_library), in two rounds; with --kernels the "
                             "GEMM table under each too")
    parser.add_argument("--prefill-lengths", nargs="+", type=int_at_least(1), default=[16, 64, 256],
                        help="--parts prefill: prompt lengths (every row all real tokens)")
    parser.add_argument("--prefill-graph-tokens", type=int_at_least(1), default=16384,
                        help="--parts prefill: RolloutConfig.kernels.prefill_graph_tokens of the graph variant")
    return parser


def rows_of_count(model, rows: int, args) -> list[dict]:
    """Every timed table of ``--parts`` at ``rows`` rows (dicts of :class:`StepRow` fields)."""
    cfg = model.config
    geo = Geometry.of(cfg)
    out = []
    if "attention" in args.parts:
        att, kv_bytes = attention_variants(rows, args.live, geo)
        out += [dict(rows=rows, part=f"attention x{geo.layers}", variant=name, ms=ms, kv_gb=kv_bytes / 1e9)
                for name, ms in att.items()]
    if "shared" in args.parts:
        for prefix, filled in args.shared_windows:
            out += shared_prefix_variants(rows, SharedWindow(args.live, prefix, filled, args.samples), geo)
    if "padding" in args.parts:
        out += padding_variants(rows, args.live, geo)
    if "sampler" in args.parts:
        out += [dict(rows=rows, part="sampler", variant=name, ms=ms)
                for name, ms in sampler_variants(rows, cfg.vocab_size).items()]
    if "skinny" in args.parts:
        out += skinny_variants(rows, cfg.hidden_size, cfg.intermediate_size,
                               (geo.heads + 2 * geo.kv_heads) * geo.head_dim, geo.layers, args.skinny_launches)
    if "silu" in args.parts:
        out += silu_variants(rows, cfg.hidden_size, cfg.intermediate_size, geo.layers, args.silu_launches)
    if "prefill" in args.parts:
        out += prefill_variants(model, rows, args.prefill_lengths, args.prefill_graph_tokens)
    if "step" in args.parts and args.blas:
        out += blas_ab(model, rows, args.live, args.blas)
    elif "step" in args.parts:
        out += time_steps(model, rows, args.live, *step_variant_list(args))
    if args.kernels:
        for backend in args.blas or [None]:
            with blas_backend(backend):
                table = gemm_variants(rows, cfg.hidden_size, cfg.intermediate_size, geo.heads * geo.head_dim,
                                      geo.kv_heads * geo.head_dim, geo.layers)
            suffix = f"; BLAS {backend}" if backend else ""
            out += [dict(rows=rows, part=f"GEMM x{geo.layers}", variant=f"{name} ({tflops:.0f} TFLOP/s){suffix}",
                         ms=ms) for name, (ms, tflops) in table.items()]
    return out


def main(argv=None) -> list[StepRow]:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    problem = window_problem(args)
    if problem:
        parser.error(problem)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.decode_step needs a CUDA device")
    model = shaped_model("qwen25-3b", dtype=torch.bfloat16, device="cuda")
    rows = []
    kernel_tables = []
    listed = StepVariant(KERNEL_VARIANTS[args.kernel_variant])
    for count in args.rows:
        rows += [StepRow(**r) for r in rows_of_count(model, count, args)]
        if args.kernels:
            kernel_tables.append(step_kernels(model, count, args.live, listed))
    meta = run_meta("decode_step", argv, "cuda", live=args.live, parts=args.parts)
    print(f"{header(meta)}; live {args.live} columns")
    print(markdown_table(["rows", "part", "variant", "ms"], [[r.rows, r.part, r.variant, fmt(r.ms)] for r in rows]))
    if args.json:
        results.write(args.json, meta, rows)
    for table in kernel_tables:
        print(table)
    if args.profile_call:
        for temperature in (1.0, 0.0):
            print(f"## one call: 64 prompts x 4, prompt 256, 256 new, temperature {temperature}")
            print(profile_call(model, 64, 4, (256, 256), temperature))
    return rows

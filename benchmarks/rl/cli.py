"""``python -m benchmarks.rl``: the command line of the RL suite (see :mod:`benchmarks.rl`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from typing import Optional

from benchmarks.harness import results
from benchmarks.harness.cli import parse_settings
from benchmarks.harness.device import measure_rates, print_tuned_plans, rates_meta
from benchmarks.harness.meta import header, run_meta
from benchmarks.harness.models import add_model_args, load_model, model_geometry
from benchmarks.rl import busy
from benchmarks.rl.cell import run_cell
from benchmarks.rl.cells import SAMPLING_SEED, SCALE_DIVISORS, select_cells
from benchmarks.rl.rows import RlRow, format_table, load_rows, sort_rows
from benchmarks.rl.running import Bench
from benchmarks.rl.scales import eos_scale_for, norm_factor_for
from rollout import RolloutConfig

FIXED_CANDIDATES = {"auto", "ordinary", "continuous", "continuous/1", "continuous/2", "continuous/4", "deepspeed"}


def build_parser() -> argparse.ArgumentParser:
    from benchmarks import rl

    parser = argparse.ArgumentParser(prog="python -m benchmarks.rl", description=rl.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--scale", choices=sorted(SCALE_DIVISORS), default="full",
                        help="small: prompt lengths, budgets and target means / 16")
    parser.add_argument("--cells", help="names or indices, comma-separated (default all)")
    parser.add_argument("--max-prompts", type=int, default=None, help="at most this many prompts per cell "
                        "(smoke tests; the rows and slot counts shrink with it)")
    parser.add_argument("--candidates", help="auto, ordinary, continuous, continuous/1|2|4, continuous-S, deepspeed")
    parser.add_argument("--repeats", type=int, default=2, help="timed rounds")
    parser.add_argument("--seeds", type=int, default=1, help="sampled cells: timed round r draws with seed "
                        f"{SAMPLING_SEED} + r %% SEEDS (every candidate of a round the same), so the means average "
                        "the realised lengths out; 1: every call the same seed, the same tokens")
    parser.add_argument("--upstream", action="store_true", help="also DeepSpeed 0.19.8 no-CB, where under the cap")
    parser.add_argument("--upstream-cap-s", type=float, default=30.0, help="estimated seconds a call, above: not run")
    parser.add_argument("--busy", choices=["on", "off"], default="on", help="one profiled call per candidate (CUDA)")
    parser.add_argument("--busy-max-events", type=int, default=busy.BusyOptions.max_events)
    parser.add_argument("--trace-dir", help="write each candidate's profiled call as a Chrome trace here, host "
                        "included (set OPSD_PROFILE=1 for our stage ranges; then scripts/summarize_trace.py)")
    parser.add_argument("--cupti-teardown", action="store_true", help="set TEARDOWN_CUPTI=1 around each profiled "
                        "call so no CUPTI callbacks linger into later timed calls (torch warns that CUDA graphs and "
                        "CUPTI re-init have crashed on older CUDA)")
    parser.add_argument("--sampler-ab", action="store_true", help="on top-p cells, also each candidate with "
                        "sampler.fused=False (the compiled search instead of the one-kernel nucleus), interleaved")
    parser.add_argument("--twin", action="append", default=[], metavar="SETTING=VALUE[;SETTING=VALUE]",
                        help="also each candidate with these RolloutConfig settings (dotted names), e.g. "
                        "kernels.fuse_qkv=False or \"kernels.decode_attention='sdpa';kernels.fused_kv_write=False\" "
                        "(repeatable: one twin each)")
    parser.add_argument("--sequential", action="store_true", help="one candidate at a time, released in between")
    parser.add_argument("--cap-gib", type=float, default=None, help="the capped cell's max_cache_gib (default: what "
                        "128 continuous slots with refills need, see cap_gib_for_slots)")
    parser.add_argument("--nucleus-target", type=int, default=None, help="peaked cell: median nucleus at most this "
                        "(default min(1000, vocab/8))")
    parser.add_argument("--eos-scales", help="JSON of calibrated scales: read if present, written if not "
                        "(default: rl-scales.json next to --json)")
    parser.add_argument("--calibrate-only", action="store_true", help="find the selected cells' scales, then exit")
    parser.add_argument("--commit-label", help="the rows' source (default: the commit); recorded in the meta")
    parser.add_argument("--json", help="write the result file here (rewritten after every cell)")
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="print one table from several result files")
    return parser


def parse_args(argv) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats: must be >= 1")
    if args.seeds < 1 or args.seeds > args.repeats:
        parser.error(f"--seeds: must be in 1..--repeats ({args.repeats}); got {args.seeds}")
    try:
        args.cell_specs = select_cells(args.cells)
    except ValueError as exc:
        parser.error(str(exc))
    args.candidate_set = _parse_candidates(parser, args.candidates)
    args.twins = tuple(parse_settings(parser, spec) for spec in args.twin)
    if args.eos_scales is None and args.json:
        args.eos_scales = os.path.join(os.path.dirname(os.path.abspath(args.json)), "rl-scales.json")
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)
    for name in ("json", "eos_scales"):  # output folders exist before any work starts
        path = getattr(args, name)
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    for path in args.merge or ():
        if not os.path.isfile(path):
            parser.error(f"--merge: no such file {path!r}")
    return args


def _parse_candidates(parser, spec: Optional[str]) -> Optional[set[str]]:
    if not spec:
        return None
    names = {p.strip() for p in spec.split(",") if p.strip()}
    bad = [n for n in names if n not in FIXED_CANDIDATES and not (n.startswith("continuous-") and n[11:].isdigit())]
    if bad:
        parser.error(f"--candidates: unknown {bad}; use {sorted(FIXED_CANDIDATES)} or continuous-S")
    return names


@dataclass
class SuiteResult:
    """What :func:`main` returns: the rows, the last timed batch per (cell, candidate) on the CPU, the meta."""

    rows: list
    batches: dict
    meta: dict


def make_bench(args, argv: list[str]) -> tuple[Bench, dict]:
    """The model, its geometry and the measured rates; the run's meta."""
    loaded = load_model(args)
    rates = measure_rates(args.device, loaded.dtype)
    meta = run_meta("rl", argv, args.device, commit_label=args.commit_label, **rates_meta(rates),
                    model=loaded.name, dtype=str(loaded.dtype), scale=args.scale, repeats=args.repeats,
                    seeds=args.seeds, settings=RolloutConfig().settings())
    scales = {}
    if args.eos_scales and os.path.exists(args.eos_scales):
        with open(args.eos_scales) as f:
            scales = json.load(f)
    options = busy.BusyOptions(args.busy_max_events, args.cupti_teardown, args.trace_dir)
    source = args.commit_label or (meta["commit"] or "unknown")[:10]
    bench = Bench(loaded.model, loaded.name, args.device, loaded.dtype, model_geometry(loaded.model), rates, args,
                  source, scales, busy=options if args.busy == "on" and args.device.startswith("cuda") else None)
    return bench, meta


def calibrate(bench: Bench, meta: dict) -> SuiteResult:
    for spec in bench.args.cell_specs:
        cell = bench.cell(spec)
        if cell.eos:
            print(f"{spec.name}: eos {eos_scale_for(bench, cell)}", flush=True)
        if cell.peaked:
            print(f"{spec.name}: norm {norm_factor_for(bench, cell)}", flush=True)
    meta["scales"] = bench.scales
    return SuiteResult([], {}, meta)


def main(argv=None) -> SuiteResult:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.merge:
        rows = load_rows(args.merge)
        print(format_table(rows))
        return SuiteResult(rows, {}, {})
    bench, meta = make_bench(args, argv)
    print(f"{header(meta)}; model {bench.model_name} {bench.dtype}; scale {args.scale}; copy "
          f"{meta['copy_gbps']:.0f} GB/s, GEMM {meta['gemm_tflops']:.3g} TFLOP/s", flush=True)
    if args.calibrate_only:
        return calibrate(bench, meta)
    rows: list[RlRow] = []
    batches = {}
    for spec in args.cell_specs:
        try:
            cell_rows, cell_batches = run_cell(bench, spec)
        except Exception as exc:  # one broken cell does not cost the others of the command
            import traceback
            traceback.print_exc()
            cell_rows, cell_batches = [RlRow(source=bench.source, cell=spec.name, candidate="*",
                                             status=f"error: {type(exc).__name__}: {exc}"[:300])], {}
        rows += cell_rows
        batches.update({(spec.name, name): b for name, b in cell_batches.items()})
        meta["scales"] = dict(bench.scales)
        if args.json:
            results.write(args.json, meta, rows)
    print(format_table(sort_rows(rows)))
    print_tuned_plans()
    return SuiteResult(rows, batches, meta)


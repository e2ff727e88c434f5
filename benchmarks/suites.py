"""Rollout suites: decode-step variants, seed 000's smoke matrix, seed 004's workloads (``--suite rl``: the RL suite).

Runs on the GPU with the random Qwen2.5-3B-shaped model (``--model 3b``) or anywhere with the tiny model
(``--model tiny``, the default on CPU). Candidates are timed by the harness (a warm-up call each, then
``--repeats`` rounds A B C, C B A, ...; means). One markdown table; ``--json`` writes the result file.

  python -m benchmarks.suites --suite decode --model 3b
  python -m benchmarks.suites --suite seed004 --model 3b --upstream
  python -m benchmarks.suites --suite smoke000 --cells 0-15
  python -m benchmarks.suites --suite rl --cells wide-greedy --json rl.json   # python -m benchmarks.rl
  python -m benchmarks.suites --merge a.json b.json --plot out.png
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass, field
from typing import Optional

import torch

from benchmarks.harness import results
from benchmarks.harness.device import measure_rates, rates_meta
from benchmarks.harness.meta import header, run_meta
from benchmarks.harness.models import LoadedModel, add_model_args, build_model, left_padded, load_model, \
    model_geometry, upstream_rollout
from benchmarks.harness.rounds import Rounds, Timer, time_rounds
from benchmarks.harness.table import fmt, markdown_table
from instrumentation.roofline import Rates, call_roofline_s, decode_step_floor_s
from rollout import KernelConfig, Rollout, RolloutConfig, RolloutRequest, RoutingConfig, SamplingConfig
from rollout.testing import TinyTokenizer

FILL_TOKEN = 14990  # seed 004: inputs repeat one non-special token id
SEED004_NEW_TOKENS = 16
SEED004 = {
    "short-similar": [20 - (i % 8) for i in range(32)],
    "1x512+31x16": [512] + [16] * 31,
    "1x20+31x1": [20] + [1] * 31,
    "1x128+31x4": [128] + [4] * 31,
    "16..512": [16 * (i + 1) for i in range(32)],
    "1x8192+31x256": [8192] + [256] * 31,
}
DECODE_VARIANTS = {
    "hf_forward": {"kernels.fast_decode": False},
    "fast_eager": {"kernels.cuda_graphs": False, "kernels.compile": False},
    "fast_graph": {"kernels.compile": False},
    "fast_graph_compiled": {},
}
#: ``CallStats`` fields a seed-004 row of ours records (by dotted name).
SEED004_STATS = ("route", "prefill.forwards", "prefill.graph_passes", "prefill.attention_groups", "decode.path")


@dataclass
class Row:
    suite: str
    cell: str
    candidate: str
    e2e_ms: float
    extra: dict = field(default_factory=dict)


def suite_decode(model, tok, device: str, repeats: int, rates: Rates) -> list[Row]:
    """Decode step ms at 32 rows, prompt 128: E2E(66 new tokens) - E2E(2) over 64 steps, against the step's
    floor (every weight and the live KV read once at the copy rate, the mean live length over the 64 steps)."""
    ids, mask = left_padded([128] * 32, model.config.vocab_size, device)
    candidates = {}
    for name, settings in DECODE_VARIANTS.items():
        ro = Rollout(model, tok, RolloutConfig().with_settings(settings))
        for new in (2, 66):
            sampling = SamplingConfig(max_new_tokens=new, temperature=0.0)
            candidates[(name, new)] = (lambda ro=ro, s=sampling: ro.generate(RolloutRequest(ids, mask), s))
    means = {k: statistics.mean(v) for k, v in time_rounds(candidates, Rounds(repeats), Timer(device)).items()}
    floor_ms = 1e3 * decode_step_floor_s(model_geometry(model), 32 * (128 + 34), rates)
    rows = []
    for name in DECODE_VARIANTS:
        step_ms = (means[(name, 66)] - means[(name, 2)]) / 64
        rows.append(Row("decode", "B=32 prompt=128", name, means[(name, 66)],
                        {"step_ms": step_ms, "floor_ms": floor_ms, "x_floor": step_ms / floor_ms}))
    return rows


def suite_smoke000(model: LoadedModel, tok, cells: list[int], repeats: int, rates: Rates) -> list[Row]:
    """Seed 000's smoke matrix (:mod:`benchmarks.smoke000`)."""
    from benchmarks.smoke000 import run_cells

    results_ = run_cells(lambda: build_model(model.name, model.dtype, model.device), tok, model.device, cells,
                         repeats=repeats, rates=rates)
    return [Row("smoke000", r.pop("cell"), "ours", r.pop("e2e_ms"), r) for r in results_]


def _ours(model, tok, cost_config, prefill_graph_tokens) -> dict:
    routing = RoutingConfig(cost_model=cost_config)
    ours = {f"ours_{route}": Rollout(model, tok, RolloutConfig(route=route, routing=routing))
            for route in ("ordinary", "auto", "continuous")}
    # A/B of the prefill path: the ordinary route with the HF layers' prefill (not a route of its own)
    ours["ours_ordinary_hf_prefill"] = Rollout(model, tok, RolloutConfig(kernels=KernelConfig(fast_prefill=False)))
    if prefill_graph_tokens is not None:
        ours[f"ours_auto_prefill_graph_{prefill_graph_tokens}"] = Rollout(
            model, tok, RolloutConfig(route="auto", routing=routing,
                                      kernels=KernelConfig(prefill_graph_tokens=prefill_graph_tokens)))
    return ours


def _upstream_candidates(up, ids, mask, name: str, rows: list) -> dict:
    from deepspeed.runtime.rollout import RolloutRequest as UpRequest
    from deepspeed.runtime.rollout import SamplingConfig as UpSampling

    plain = UpSampling(max_new_tokens=SEED004_NEW_TOKENS, temperature=0.0)
    out = {"deepspeed_no_cb": lambda: up.generate(UpRequest(ids, mask), plain)}
    cb = UpSampling(max_new_tokens=SEED004_NEW_TOKENS, temperature=0.0, continuous_batch_size=32)
    try:
        up.generate(UpRequest(ids, mask), cb)
        out["deepspeed_cb"] = lambda: up.generate(UpRequest(ids, mask), cb)
    except Exception as exc:  # recorded, not hidden: upstream CB fails on transformers 5.x
        rows.append(Row("seed004", name, "deepspeed_cb", float("nan"), {"error": repr(exc)[:200]}))
    return out


def suite_seed004(model, tok, device: str, names: list[str], *, repeats: int = 3, upstream: bool = False,
                  cost_config=None, rates: Optional[Rates] = None, prefill_graph_tokens: Optional[int] = None) -> list[Row]:
    """Seed 004's workloads (32 prompts, 16 greedy tokens each). ``rates``: with them every row carries its
    ``roofline_ms`` and ``x_roofline`` (issue 15's target: <= 3x). ``prefill_graph_tokens`` (an int, 0 included)
    adds the candidate ``ours_auto_prefill_graph_<N>``: Auto with ``kernels.prefill_graph_tokens`` set to it."""
    geo = model_geometry(model) if rates is not None else None
    ours = _ours(model, tok, cost_config, prefill_graph_tokens)
    up = upstream_rollout(model, tok) if upstream else None
    rows = []
    for name in names:
        lengths = SEED004[name]
        ids, mask = left_padded(lengths, model.config.vocab_size, device, token=FILL_TOKEN % model.config.vocab_size)
        sampling = SamplingConfig(max_new_tokens=SEED004_NEW_TOKENS, temperature=0.0)
        roofline = None if geo is None else 1e3 * call_roofline_s(lengths, 1, [SEED004_NEW_TOKENS] * len(lengths),
                                                                  geo, rates)
        candidates = {k: (lambda ro=ro: ro.generate(RolloutRequest(ids, mask), sampling)) for k, ro in ours.items()}
        if up is not None:
            candidates.update(_upstream_candidates(up, ids, mask, name, rows))
        times = time_rounds(candidates, Rounds(repeats), Timer(device))
        means = {k: statistics.mean(v) for k, v in times.items()}
        outputs = {k: ro.generate(RolloutRequest(ids, mask), sampling).input_ids for k, ro in ours.items()}
        same = all(torch.equal(v, outputs["ours_ordinary"]) for v in outputs.values())
        best_up = min((v for k, v in means.items() if k.startswith("deepspeed")), default=float("nan"))
        best_ours = min(means[k] for k in ("ours_ordinary", "ours_continuous"))
        for cand, ms in means.items():
            extra = {"tokens_per_s": 512 / (ms / 1000.0), "vs_best_upstream": ms / best_up}
            if roofline is not None:
                extra.update(roofline_ms=roofline, x_roofline=ms / roofline)
            if cand in ours:
                flat = ours[cand].last_stats.flat()
                extra.update({key: flat[key] for key in SEED004_STATS}, same_tokens_as_ordinary=same)
            if cand == "ours_auto":
                extra["auto_vs_best_own"] = ms / best_ours
            rows.append(Row("seed004", name, cand, ms, extra))
    return rows


def format_rows(rows: list[Row]) -> str:
    def details(extra: dict) -> str:
        return ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in extra.items())

    return markdown_table(["suite", "cell", "candidate", "E2E ms", "details"],
                          [[r.suite, r.cell, r.candidate, fmt(r.e2e_ms, ".2f"), details(r.extra)] for r in rows])


def plot_rows(rows: list[Row], path: str) -> None:
    """PNG: per smoke cell, stacked prefill / decode / post-processing / cache / other ms; per seed 004
    workload, E2E per candidate."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    smoke = [r for r in rows if r.suite == "smoke000" and r.extra.get("prefill_ms") is not None]
    seed = [r for r in rows if r.suite == "seed004" and r.e2e_ms is not None and r.e2e_ms == r.e2e_ms]  # timed
    panels = [p for p, rows_of in (("smoke", smoke), ("seed", seed)) if rows_of]
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(8, len(smoke) * 0.35), 5 * len(panels)), squeeze=False)
    axes = {name: ax for name, ax in zip(panels, axes[:, 0])}
    if smoke:
        _plot_smoke(axes["smoke"], smoke)
    if seed:
        _plot_seed(axes["seed"], seed)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _plot_smoke(ax, smoke: list[Row]) -> None:
    parts = ("prefill_ms", "decode_ms", "postprocess_ms", "cache_ms")
    bottom = [0.0] * len(smoke)
    for part in parts:
        values = [r.extra.get(part) or 0.0 for r in smoke]
        ax.bar(range(len(smoke)), values, bottom=bottom, label=part[:-3])
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.bar(range(len(smoke)), [max(r.e2e_ms - b, 0.0) for r, b in zip(smoke, bottom)], bottom=bottom, label="other")
    ax.set_xticks(range(len(smoke)), [r.cell for r in smoke], rotation=90, fontsize=6)
    ax.set_ylabel("ms")
    ax.set_title("seed 000 smoke matrix: stage breakdown per cell")
    ax.legend()


def _plot_seed(ax, seed: list[Row]) -> None:
    workloads = list(dict.fromkeys(r.cell for r in seed))
    candidates = list(dict.fromkeys(r.candidate for r in seed))
    width = 0.8 / max(len(candidates), 1)
    for k, cand in enumerate(candidates):
        values = [next((r.e2e_ms for r in seed if r.cell == w and r.candidate == cand), 0.0) for w in workloads]
        ax.bar([i + k * width for i in range(len(workloads))], values, width, label=cand)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(workloads))], workloads, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("E2E ms (log)")
    ax.set_title("seed 004 workloads")
    ax.legend(fontsize=7)


def parse_cells(spec: Optional[str], total: int) -> list[int]:
    if not spec:
        return list(range(total))
    cells = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cells.extend(range(int(lo), int(hi or lo) + 1))
    return [c for c in cells if c < total]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.suites", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=["decode", "smoke000", "seed004", "rl", "all"], default="all",
                        help="rl: RL-scale cells (python -m benchmarks.rl; its own options)")
    add_model_args(parser)
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds")
    parser.add_argument("--cells", help="smoke000 cells to run, e.g. 0-7,12 (of 64: ZeRO-0 then ZeRO-3)")
    parser.add_argument("--workloads", default=None, help="seed004 workloads, comma-separated (default all)")
    parser.add_argument("--upstream", action="store_true", help="also time DeepSpeed's HybridEngineRollout")
    parser.add_argument("--cost-config", help="calibration JSON for route=auto (scripts/calibrate_prefill.py)")
    parser.add_argument("--prefill-graph-tokens", type=int, default=None,
                        help="seed004: also time Auto with RolloutConfig.kernels.prefill_graph_tokens set to this "
                             "(A/B against the default; 0: off)")
    parser.add_argument("--json", help="write the result file here")
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="merge shards' result files into one table")
    parser.add_argument("--plot", help="with --merge (or a run): a PNG of the breakdown per workload")
    return parser


def run_suites(args, model, rates: Rates) -> list[Row]:
    tok = TinyTokenizer(pad_token_id=0, eos_token_id=None)
    rows: list[Row] = []
    if args.suite in ("decode", "all"):
        rows += suite_decode(model.model, tok, args.device, args.repeats, rates)
    if args.suite in ("seed004", "all"):
        names = args.workloads.split(",") if args.workloads else list(SEED004)
        if model.name == "tiny":
            names = [n for n in names if n != "1x8192+31x256"]
        rows += suite_seed004(model.model, tok, args.device, names, repeats=args.repeats, upstream=args.upstream,
                              cost_config=args.cost_config, rates=rates,
                              prefill_graph_tokens=args.prefill_graph_tokens)
    if args.suite in ("smoke000", "all"):
        from benchmarks.smoke000 import CELLS
        rows += suite_smoke000(model, tok, parse_cells(args.cells, len(CELLS)), args.repeats, rates)
    return rows


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--suite")
    known, rest = pre.parse_known_args(argv)
    if known.suite == "rl":  # the RL-scale suite has its own options: python -m benchmarks.rl --help
        from benchmarks.rl.cli import main as rl_main
        return rl_main(rest)
    args = build_parser().parse_args(argv)
    if args.merge:
        rows = [row for path in args.merge for row in results.rows_of(Row, results.read(path))]
        print(format_rows(rows))
        if args.plot:
            plot_rows(rows, args.plot)
        return rows
    model = load_model(args)
    rates = measure_rates(args.device, model.dtype)
    meta = run_meta("suites", argv, args.device, model=model.name, dtype=str(model.dtype), repeats=args.repeats,
                    **rates_meta(rates))
    print(f"{header(meta)}; model {model.name} {model.dtype}; repeats {args.repeats}; copy {meta['copy_gbps']:.0f} "
          f"GB/s, GEMM {meta['gemm_tflops']:.3g} TFLOP/s", flush=True)
    rows = run_suites(args, model, rates)
    print(format_rows(rows))
    if args.plot:
        plot_rows(rows, args.plot)
    if args.json:
        results.write(args.json, meta, rows)
    return rows


if __name__ == "__main__":
    main()

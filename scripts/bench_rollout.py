#!/usr/bin/env python
"""Rollout benchmarks: decode-step variants, seed 000's smoke matrix, seed 004's workloads.

Runs on the GPU with the random Qwen2.5-3B-shaped model (``--model 3b``) or anywhere with the tiny
model (``--model tiny``, the default on CPU). Candidates are interleaved (A B C A B C ...) after a
warm-up; means of ``--repeats``. Every cell prints a markdown row; ``--json`` writes all rows.

  python scripts/bench_rollout.py --suite decode --model 3b
  python scripts/bench_rollout.py --suite seed004 --model 3b --upstream
  python scripts/bench_rollout.py --suite smoke000 --cells 0-15
  python scripts/bench_rollout.py --suite rl --cells wide-greedy --json rl.json   # see scripts/bench_rl.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rollout import KernelConfig, Rollout, RolloutConfig, RolloutRequest, RoutingConfig, SamplingConfig  # noqa: E402
from rollout.testing import TinyTokenizer, shaped_model, tiny_model  # noqa: E402

FILL_TOKEN = 14990  # seed 004: inputs repeat one non-special token id

SEED004 = {
    "short-similar": [20 - (i % 8) for i in range(32)],
    "1x512+31x16": [512] + [16] * 31,
    "1x20+31x1": [20] + [1] * 31,
    "1x128+31x4": [128] + [4] * 31,
    "16..512": [16 * (i + 1) for i in range(32)],
    "1x8192+31x256": [8192] + [256] * 31,
}

DECODE_VARIANTS = {
    "hf_forward": {'kernels.fast_decode': False},
    "fast_eager": {'kernels.cuda_graphs': False, 'kernels.compile': False},
    "fast_graph": {'kernels.compile': False},
    "fast_graph_compiled": dict(),
}


@dataclass
class Row:
    suite: str
    cell: str
    candidate: str
    e2e_ms: float
    extra: dict = field(default_factory=dict)


def build_model(name: str, dtype: torch.dtype, device: str):
    if name == "tiny":
        return tiny_model("qwen2", seed=0, dtype=dtype, device=device, max_position_embeddings=16384)
    return shaped_model("qwen25-3b", seed=0, dtype=dtype, device=device)


def left_padded(lengths: list[int], vocab: int, device: str, token: int | None = None):
    width = max(lengths)
    gen = torch.Generator().manual_seed(0)
    ids = torch.zeros((len(lengths), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        fill = torch.full((length,), token) if token is not None else torch.randint(3, vocab, (length,), generator=gen)
        ids[row, width - length:] = fill
        mask[row, width - length:] = 1
    return ids.to(device), mask.to(device)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return (time.perf_counter() - start) * 1000.0


def round_order(items: list, round_index: int) -> list:
    """The order of one timed round: as given in even rounds, reversed in odd ones (A B C, C B A, A B C ...),
    so no candidate always sits in the same place or follows the same one (with a fixed order, seed 004's
    16..512 ran 3.5-4.5% slower at the default than its ``prefill_graph_tokens=0`` twin, which always ran
    last, though both passes ran eagerly: docs/BENCHMARKS.md, 2026-12-02; with rounds alternating the gap
    stayed, 157.0 against 149.3 ms, so the order was not its cause)."""
    return list(items) if round_index % 2 == 0 else list(reversed(items))


def interleave(candidates: dict, device: str, repeats: int) -> dict[str, float]:
    """Warm up every candidate, then time them in ``repeats`` rounds (:func:`round_order`: A B C, C B A, ...);
    returns mean ms per candidate."""
    for fn in candidates.values():
        fn()
    times = {name: [] for name in candidates}
    for r in range(repeats):
        for name in round_order(list(candidates), r):
            times[name].append(timed(candidates[name], device))
    return {name: statistics.mean(v) for name, v in times.items()}


def copy_bandwidth_gbps(device: str) -> float:
    """Measured device copy bandwidth (bytes read + written per second), for the floor."""
    if not device.startswith("cuda"):
        return float("nan")
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    ms = statistics.median(timed(lambda: y.copy_(x), device) for _ in range(10))
    return 2 * x.numel() / (ms / 1000.0) / 1e9


def weight_bytes(model) -> int:
    """Bytes of the full weights (under ZeRO-3 a parameter's local tensor is a partition: ``ds_numel``
    is its full size), tied weights counted once."""
    return sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in model.parameters())


def suite_decode(model, tok, device, repeats, bandwidth_gbps) -> list[Row]:
    """Decode step ms at 32 rows, prompt 128: E2E(66 new tokens) - E2E(2) over 64 steps."""
    ids, mask = left_padded([128] * 32, model.config.vocab_size, device)
    rows = []
    candidates = {}
    for name, cfg in DECODE_VARIANTS.items():
        ro = Rollout(model, tok, RolloutConfig().with_settings(cfg))
        for new in (2, 66):
            sampling = SamplingConfig(max_new_tokens=new, temperature=0.0)
            candidates[(name, new)] = (lambda ro=ro, s=sampling: ro.generate(RolloutRequest(ids, mask), s))
    means = interleave(candidates, device, repeats)
    kv_bytes_per_row_col = 2 * model.config.num_hidden_layers * model.config.num_key_value_heads * \
        (model.config.hidden_size // model.config.num_attention_heads) * next(model.parameters()).element_size()
    live_kv = 32 * (128 + 34) * kv_bytes_per_row_col  # mean live length over the 64 steps
    # the floor reads every weight and the live KV once at the measured copy rate (bytes read + written
    # per second, the convention of MEASUREMENTS.md: 6.17 GB / 4.25 TB/s = 1.45 ms)
    floor_ms = (weight_bytes(model) + live_kv) / (bandwidth_gbps * 1e9) * 1000.0
    for name in DECODE_VARIANTS:
        step_ms = (means[(name, 66)] - means[(name, 2)]) / 64
        rows.append(Row("decode", "B=32 prompt=128", name, means[(name, 66)],
                        {"step_ms": step_ms, "floor_ms": floor_ms, "x_floor": step_ms / floor_ms}))
    return rows


def suite_smoke000(model_name, dtype, tok, device, repeats, cells, bandwidth_gbps) -> list[Row]:
    """Seed 000's smoke matrix (see ``scripts/bench_smoke000.py``)."""
    from scripts.bench_smoke000 import run_cells

    def floor_ms(model, rows, mean_live):
        if bandwidth_gbps != bandwidth_gbps:  # nan: no GPU
            return None
        cfg = model.config
        kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
        live = rows * mean_live * kv * next(model.parameters()).element_size()
        return (weight_bytes(model) + live) / (bandwidth_gbps * 1e9) * 1000.0

    results = run_cells(lambda: build_model(model_name, dtype, device), tok, device, repeats, cells,
                        timed, left_padded, floor_ms)
    return [Row("smoke000", r.pop("cell"), "ours", r.pop("e2e_ms"), r) for r in results]


def upstream_rollout(model, tok, device, continuous: bool):
    """DeepSpeed 0.19.8's HybridEngineRollout on a ZeRO-0 engine (single process)."""
    import deepspeed
    from deepspeed.runtime.rollout import HybridEngineRollout
    from deepspeed.runtime.rollout.hybrid_engine_rollout import HybridEngineRolloutConfig

    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29511", RANK="0", WORLD_SIZE="1",
                           LOCAL_RANK="0").items():
        os.environ.setdefault(key, value)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0},
              "bf16": {"enabled": next(model.parameters()).dtype == torch.bfloat16}}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    cfg = HybridEngineRolloutConfig(align_decode_fronts=continuous) if continuous else HybridEngineRolloutConfig()
    return HybridEngineRollout(engine, tok, cfg)


SEED004_NEW_TOKENS = 16


def seed004_roofline_ms(prompt_lens: list[int], geo, bw_bytes_s: float, flops_s: float) -> float:
    """Issue 15's roofline of one seed-004 call (``scripts/bench_rl.call_roofline_s``): one sample per
    prompt, greedy, no EOS, so every row decodes ``SEED004_NEW_TOKENS`` tokens."""
    from scripts.bench_rl import call_roofline_s

    return 1e3 * call_roofline_s(prompt_lens, 1, [SEED004_NEW_TOKENS] * len(prompt_lens), geo, bw_bytes_s, flops_s)


def suite_seed004(model, tok, device, repeats, upstream: bool, names, cost_config=None,
                  rates: tuple[float, float] | None = None,
                  prefill_graph_tokens: int | None = None) -> list[Row]:
    """``rates``: (copy bytes/s, GEMM FLOP/s) measured in this run; with them every row carries its
    ``roofline_ms`` and ``x_roofline`` (issue 15's target: <= 3x). ``prefill_graph_tokens`` (an int, 0
    included) adds the candidate ``ours_auto_prefill_graph_<N>``: Auto with ``RolloutConfig.kernels.prefill_graph_tokens``
    set to it (an A/B against the default's)."""
    geo = None
    if rates is not None:
        from scripts.bench_rl import model_geometry
        geo = model_geometry(model)
    ours = {f"ours_{route}": Rollout(model, tok, RolloutConfig(route=route, routing=RoutingConfig(cost_model=cost_config)))
            for route in ("ordinary", "auto", "continuous")}
    # A/B of the prefill path: the ordinary route with the HF layers' prefill (not a route of its own)
    ours["ours_ordinary_hf_prefill"] = Rollout(model, tok, RolloutConfig(kernels=KernelConfig(fast_prefill=False)))
    if prefill_graph_tokens is not None:
        ours[f"ours_auto_prefill_graph_{prefill_graph_tokens}"] = Rollout(
            model, tok, RolloutConfig(routing=RoutingConfig(cost_model=cost_config), kernels=KernelConfig(prefill_graph_tokens=prefill_graph_tokens)))
    up = upstream_rollout(model, tok, device, continuous=False) if upstream else None
    rows = []
    for name in names:
        lengths = SEED004[name]
        ids, mask = left_padded(lengths, model.config.vocab_size, device, token=FILL_TOKEN % model.config.vocab_size)
        sampling = SamplingConfig(max_new_tokens=SEED004_NEW_TOKENS, temperature=0.0)
        roofline = seed004_roofline_ms(lengths, geo, *rates) if geo is not None else None
        candidates = {name: (lambda ro=ro: ro.generate(RolloutRequest(ids, mask), sampling))
                      for name, ro in ours.items()}
        if up is not None:
            from deepspeed.runtime.rollout import RolloutRequest as UpRequest
            from deepspeed.runtime.rollout import SamplingConfig as UpSampling
            up_sampling = UpSampling(max_new_tokens=16, temperature=0.0)
            candidates["deepspeed_no_cb"] = lambda: up.generate(UpRequest(ids, mask), up_sampling)
            cb = UpSampling(max_new_tokens=16, temperature=0.0, continuous_batch_size=32)
            try:
                up.generate(UpRequest(ids, mask), cb)
                candidates["deepspeed_cb"] = lambda: up.generate(UpRequest(ids, mask), cb)
            except Exception as exc:  # recorded, not hidden: upstream CB fails on transformers 5.x
                rows.append(Row("seed004", name, "deepspeed_cb", float("nan"), {"error": repr(exc)[:200]}))
        means = interleave(candidates, device, repeats)
        outputs = {k: ro.generate(RolloutRequest(ids, mask), sampling).input_ids for k, ro in ours.items()}
        same = all(torch.equal(v, outputs["ours_ordinary"]) for v in outputs.values())
        best_up = min((v for k, v in means.items() if k.startswith("deepspeed")), default=float("nan"))
        best_ours = min(means[k] for k in ("ours_ordinary", "ours_continuous"))
        for cand, ms in means.items():
            extra = {"tokens_per_s": 512 / (ms / 1000.0), "vs_best_upstream": ms / best_up}
            if roofline is not None:
                extra.update(roofline_ms=roofline, x_roofline=ms / roofline)
            if cand in ours:
                stats = ours[cand].last_stats
                extra.update(route=stats.get("route"), prefill_forwards=stats.get("prefill_forwards"),
                             prefill_graph_passes=stats.get("prefill_graph_passes"),
                             prefill_attention_groups=stats.get("prefill_attention_groups"),
                             decode_path=stats.get("decode_path"), same_tokens_as_ordinary=same)
            if cand == "ours_auto":
                extra["auto_vs_best_own"] = ms / best_ours
            rows.append(Row("seed004", name, cand, ms, extra))
    return rows


def print_rows(rows: list[Row]) -> None:
    print("| suite | cell | candidate | E2E ms | details |")
    print("|---|---|---|---:|---|")
    for r in rows:
        details = ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.extra.items())
        print(f"| {r.suite} | {r.cell} | {r.candidate} | {r.e2e_ms:.2f} | {details} |")


def plot_rows(rows: list[Row], path: str) -> None:
    """PNG: per smoke cell, stacked prefill / decode / post-processing / cache / other ms; per seed 004
    workload, E2E per candidate."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    smoke = [r for r in rows if r.suite == "smoke000" and r.extra.get("prefill_ms") is not None]
    seed = [r for r in rows if r.suite == "seed004" and r.e2e_ms == r.e2e_ms]
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


def parse_cells(spec: str | None, total: int) -> list[int]:
    if not spec:
        return list(range(total))
    cells = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cells.extend(range(int(lo), int(hi or lo) + 1))
    return [c for c in cells if c < total]


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--suite")
    known, rest = pre.parse_known_args(argv)
    if known.suite == "rl":  # the RL-scale suite has its own options: scripts/bench_rl.py --help
        from scripts.bench_rl import main as rl_main
        return rl_main(rest)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=["decode", "smoke000", "seed004", "rl", "all"], default="all",
                        help="rl: RL-scale cells (scripts/bench_rl.py; its own options)")
    parser.add_argument("--model", choices=["tiny", "3b"], default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="bfloat16 on CUDA, float32 on CPU by default")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cells", help="smoke000 cells to run, e.g. 0-7,12 (of 64: ZeRO-0 then ZeRO-3)")
    parser.add_argument("--workloads", default=None, help="seed004 workloads, comma-separated (default all)")
    parser.add_argument("--upstream", action="store_true", help="also time DeepSpeed's HybridEngineRollout")
    parser.add_argument("--cost-config", help="calibration JSON for route=auto (scripts/calibrate_prefill.py)")
    parser.add_argument("--prefill-graph-tokens", type=int, default=None,
                        help="seed004: also time Auto with RolloutConfig.kernels.prefill_graph_tokens set to this (A/B against "
                             "the default; 0: off)")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="merge shards' --json files into one table")
    parser.add_argument("--plot", help="with --merge (or a run): a PNG of the breakdown per workload")
    args = parser.parse_args(argv)
    if args.merge:
        rows = [Row(**r) for path in args.merge for r in json.load(open(path))]
        print_rows(rows)
        if args.plot:
            plot_rows(rows, args.plot)
        return
    model_name = args.model or ("3b" if args.device.startswith("cuda") else "tiny")
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if args.device.startswith("cuda")
                                                           else torch.float32)
    model = build_model(model_name, dtype, args.device)
    tok = TinyTokenizer(pad_token_id=0, eos_token_id=None)
    import transformers
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    print(f"# {time.strftime('%Y-%m-%d')} {gpu}; torch {torch.__version__}, transformers "
          f"{transformers.__version__}; model {model_name} {dtype}; repeats {args.repeats}")
    bandwidth = copy_bandwidth_gbps(args.device)
    rows: list[Row] = []
    if args.suite in ("decode", "all"):
        rows += suite_decode(model, tok, args.device, args.repeats, bandwidth)
    if args.suite in ("seed004", "all"):
        names = args.workloads.split(",") if args.workloads else list(SEED004)
        if model_name == "tiny":
            names = [n for n in names if n != "1x8192+31x256"]
        rates = None
        if args.device.startswith("cuda"):  # the roofline's rates, measured here (issue 15, Definitions)
            from scripts.bench_rl import measure_rates
            bw_gbps, gemm_tflops = measure_rates(args.device, dtype)
            rates = (bw_gbps * 1e9, gemm_tflops * 1e12)
            print(f"roofline rates: copy {bw_gbps:.0f} GB/s, GEMM {gemm_tflops:.0f} TFLOP/s")
        rows += suite_seed004(model, tok, args.device, args.repeats, args.upstream, names, args.cost_config, rates,
                              args.prefill_graph_tokens)
    if args.suite in ("smoke000", "all"):
        from scripts.bench_smoke000 import CELLS
        rows += suite_smoke000(model_name, dtype, tok, args.device, args.repeats, parse_cells(args.cells, len(CELLS)),
                               bandwidth)
    print(f"copy bandwidth {bandwidth:.0f} GB/s")
    print_rows(rows)
    if args.plot:
        plot_rows(rows, args.plot)
    if args.json:
        from scripts.bench_rl import json_safe
        with open(args.json, "w") as f:  # strict JSON: a missing figure (NaN) is written as null
            json.dump(json_safe([asdict(r) for r in rows]), f, indent=1, allow_nan=False)


if __name__ == "__main__":
    main()

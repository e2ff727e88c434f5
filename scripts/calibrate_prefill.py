#!/usr/bin/env python
"""Calibrate the planner's ``CostModel`` on this model/device/dtype, then check Auto on held-out workloads.

Calibration measures prefill forwards over a grid of (batch, length) shapes (through the packed
prefill of ``rollout.fast_prefill`` where the model supports it, as the engine runs it), the extra cost of
splitting one packed prefill into attention groups, the copy of a bucket's
keys/values into the aligned cache over the same grid, and the continuous route's extra decode
milliseconds per step over the ordinary route (``E2E(short + K tokens) - E2E(short)`` of both, EOS
off); fits non-negative coefficients (``rollout.calibration.fit_cost_model``) and writes them with
their metadata as JSON. Candidates are timed after a warm-up, synchronised, median of ``--repeats``.

The sweep (``--sweep --cost-config FILE``) loads the coefficients (refusing a file made for another
device/dtype/backend/version/source) and times, interleaved, ``Rollout`` with ``route="ordinary"``,
``"continuous"`` and ``"auto"`` on workloads meant to make Auto pick each route (one more workload
runs with fewer slots than rows, where Auto must run continuous batching). It prints Auto / best manual route per
workload and the worst regression, and checks that every route returned the same tokens.

  python scripts/calibrate_prefill.py --output calib.json                  # tiny model on the CPU
  python scripts/calibrate_prefill.py --sweep --cost-config calib.json
  python scripts/calibrate_prefill.py --model 3b --device cuda --dtype bfloat16 --output calib-3b.json
  python scripts/calibrate_prefill.py --model 3b --device cuda --dtype bfloat16 --sweep \\
      --cost-config calib-3b.json --workloads seed004
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from benchmarks.harness.cli import int_at_least, out_path
from instrumentation.cli_values import parse_int_text
from rollout import KernelConfig, Rollout, RolloutConfig, RolloutRequest, RoutingConfig, SamplingConfig
from rollout.cache.aligned import AlignedKVCache
from rollout.cache.pool import ScratchArena
from rollout.executors.decode import FastStep
from rollout.model import prefill as fast_prefill
from rollout.model import step as fast_decode
from rollout.model.costs import calibration_metadata, load_cost_model
from rollout.plan.calibration import (CopySample, DecodeSample, GroupSample, PrefillSample,
                                      fit_cost_model, save_calibration)
from rollout.model.compat import mask_dtype
from rollout.cache.static import cache_shape
from rollout.model.hf import prefill_forward
from rollout.plan.planner import CostModel
from rollout.testing import TinyTokenizer, shaped_model, tiny_model

NO_EOS = TinyTokenizer(pad_token_id=0, eos_token_id=None)
#: Calibration grids per model: batches, lengths, decode shapes (batch x length), decode extra steps.
GRIDS = {
    "tiny": dict(batches="1,2,4,8", lengths="8,32,128,256", decode_shapes="8x32,4x128", decode_steps=24),
    "3b": dict(batches="1,4,16,32", lengths="32,128,512,1024", decode_shapes="32x128,8x512", decode_steps=16),
}
#: Held-out workloads (prompt lengths per request). "small" fits the tiny model's 512-token context.
WORKLOADS = {
    "small": {"uniform 8x24": [24] * 8, "1x448+15x8": [448] + [8] * 15, "1x96+7x6": [96] + [6] * 7,
              "8..128 spread": [8 * (i + 1) for i in range(16)], "1x12+15x2": [12] + [2] * 15},
    "seed004": {"short-similar": [20 - (i % 8) for i in range(32)], "1x512+31x16": [512] + [16] * 31,
                "1x20+31x1": [20] + [1] * 31, "1x128+31x4": [128] + [4] * 31,
                "16..512": [16 * (i + 1) for i in range(32)], "128x16": [16] * 128,
                "1x8192+31x256": [8192] + [256] * 31},
}


def build_model(name: str, device: str, dtype: torch.dtype, attn: str):
    if name == "tiny":
        return tiny_model("qwen2", seed=0, dtype=dtype, device=device, attn_implementation=attn)
    return shaped_model("qwen25-3b", seed=0, dtype=dtype, device=device, attn_implementation=attn)


def timed_ms(fn, device: torch.device, repeats: int, warmup: int = 1) -> float:
    """Median ms of ``fn()`` over ``repeats`` synchronised calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append((time.perf_counter() - start) * 1000.0)
    return statistics.median(samples)


def left_padded(lengths, vocab: int, device, seed: int = 0):
    """Left-padded random prompts ``(ids, mask) [B, max(lengths)]`` (ids avoid 0, 1, 2)."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros((len(lengths), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, width - length:] = torch.randint(3, vocab, (length,), generator=gen)
        mask[row, width - length:] = 1
    return ids.to(device), mask.to(device)


# ---- calibration -------------------------------------------------------------------------------
def packed_parts(model):
    """``StepParts`` of the packed prefill as the engine builds them, or None (HF forward)."""
    if fast_decode.unsupported_reason(model) is not None:
        return None
    return FastStep(model, KernelConfig(fuse_gate_up=False), mirror_weights=False).parts(
        next(model.parameters()).device,
                                                                       mirrored=False)


@torch.no_grad()
def measure_prefill(model, shapes, repeats: int) -> list[PrefillSample]:
    device = next(model.parameters()).device
    arena = ScratchArena.like(cache_shape(model, 1, 1))
    fast = packed_parts(model)
    samples = []
    for batch, length in shapes:
        ids, mask = left_padded([length] * batch, model.config.vocab_size, device)
        scratch = arena.get(batch, length)
        if fast is None:
            ms = timed_ms(lambda: prefill_forward(model, scratch, ids, mask, length, mask_dtype(model)), device,
                          repeats)
        else:
            ms = timed_ms(lambda: fast_prefill.prefill_logits(fast, scratch.key_storage, scratch.value_storage,
                                                              ids, mask), device, repeats)
        samples.append(PrefillSample(batch, length, ms))
    return samples


@torch.no_grad()
def measure_groups(model, batch: int, length: int, num_groups: int, repeats: int) -> list[GroupSample]:
    """Packed prefill of ``batch`` rows of ``length`` as one attention group vs ``num_groups`` equal ones
    (same attention GFLOPs, same tokens): the difference is the per-group overhead. Empty unless the
    packed prefill attends per group."""
    fast = packed_parts(model)
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    if fast is None or fast_prefill.varlen_attention(device, dtype) is not None:
        return []  # the HF forward has no groups; variable-length attention ignores them
    ids, mask = left_padded([length] * batch, model.config.vocab_size, device)
    cache = ScratchArena.like(cache_shape(model, 1, 1)).get(batch, length)
    size = batch // num_groups
    split = [(g * size, (g + 1) * size if g < num_groups - 1 else batch, length) for g in range(num_groups)]
    ms = {}
    for groups in (None, split, None, split):  # interleaved, twice
        ms.setdefault(groups is None, []).append(timed_ms(
            lambda: fast_prefill.prefill_logits(fast, cache.key_storage, cache.value_storage, ids, mask, groups),
            device, repeats))
    return [GroupSample(num_groups, statistics.median(ms[False]) - statistics.median(ms[True]))]


@torch.no_grad()
def measure_copies(model, shapes, repeats: int) -> list[CopySample]:
    device = next(model.parameters()).device
    samples = []
    for batch, length in shapes:
        cache = AlignedKVCache(cache_shape(model, batch, length))
        cache.reset(front=length)
        scratch = ScratchArena.like(cache.shape).get(batch, length)
        rows = torch.arange(batch, device=device)
        mask = torch.ones((batch, length), dtype=torch.long, device=device)
        ms = timed_ms(lambda: cache.write_prompts(scratch, rows, rows, mask), device, repeats)
        samples.append(CopySample(batch, length, ms))
    return samples


def measure_decode(model, shapes, extra_steps: int, repeats: int, cost_model: CostModel) -> list[DecodeSample]:
    device = next(model.parameters()).device
    ordinary = Rollout(model, NO_EOS, RolloutConfig())
    continuous = Rollout(model, NO_EOS, RolloutConfig(route="continuous", routing=RoutingConfig(cost_model=cost_model)))
    samples = []
    for batch, length in shapes:
        ids, mask = left_padded([length] * batch, model.config.vocab_size, device)
        ms = {}
        for steps in (2, 2 + extra_steps):
            sampling = SamplingConfig(max_new_tokens=steps, temperature=0.0)
            ms[("ordinary", steps)] = timed_ms(lambda: ordinary.generate(RolloutRequest(ids, mask), sampling),
                                               device, repeats)
            ms[("continuous", steps)] = timed_ms(lambda: continuous.generate(RolloutRequest(ids, mask), sampling),
                                                 device, repeats)
        extra = ((ms[("continuous", 2 + extra_steps)] - ms[("continuous", 2)])
                 - (ms[("ordinary", 2 + extra_steps)] - ms[("ordinary", 2)]))
        samples.append(DecodeSample(extra_steps, extra))
    return samples


def calibrate(args, model, device, dtype) -> dict:
    grid = {key: getattr(args, key) or GRIDS[args.model][key] for key in GRIDS[args.model]}
    shapes = [(b, n) for b in _ints(grid["batches"]) for n in _ints(grid["lengths"])
              if args.max_tokens is None or b * n <= args.max_tokens]
    geometry = CostModel.from_model(model, dtype=dtype)
    measure_prefill(model, shapes[-1:], repeats=2)  # warm-up: kernels, allocator, lazy initialisation
    prefill = measure_prefill(model, shapes, args.repeats)
    copies = measure_copies(model, shapes, args.repeats)
    decode_shapes = [tuple(_ints(s.replace("x", ","))) for s in grid["decode_shapes"].split(",")]
    decode = measure_decode(model, decode_shapes, int(grid["decode_steps"]), args.repeats, geometry)
    batches, lengths = _ints(grid["batches"]), _ints(grid["lengths"])
    groups = measure_groups(model, max(batches), lengths[len(lengths) // 2], min(8, max(batches)), args.repeats)
    fitted = fit_cost_model(geometry, prefill, copies, decode, groups)
    save_calibration(args.output, fitted, calibration_metadata(model, device, dtype),
                     {"prefill": prefill, "copies": copies, "decode": decode, "groups": groups})
    print(f"{'B':>4} {'L':>6} {'forward ms':>11} {'fit ms':>9} {'copy ms':>9} {'fit ms':>9}")
    for p, c in zip(prefill, copies):
        print(f"{p.batch_size:>4} {p.length:>6} {p.forward_ms:>11.3f} "
              f"{fitted.ordinary_prefill_cost_ms(p.batch_size, p.length):>9.3f} {c.copy_ms:>9.3f} "
              f"{fitted.prefill_kv_cost_ms * fitted.kv_mib(c.batch_size, c.length):>9.3f}")
    for (batch, length), d in zip(decode_shapes, decode):
        print(f"decode {batch}x{length}: continuous - ordinary = {d.extra_ms / d.num_steps:.3f} ms/step")
    for g in groups:
        print(f"packed prefill in {g.num_groups} attention groups - in 1 = {g.extra_ms:.3f} ms")
    coefficients = {k: v for k, v in fitted.to_dict().items() if k.endswith("_ms")}
    print(json.dumps(coefficients, indent=2))
    print(f"wrote {args.output}")
    return {"cost_model": fitted, "prefill": prefill, "copies": copies, "decode": decode, "groups": groups}


# ---- sweep -------------------------------------------------------------------------------------
@dataclass
class SweepRow:
    workload: str
    auto_route: str
    auto_buckets: int
    ordinary_ms: float
    continuous_ms: float
    auto_ms: float
    auto_over_best: float
    tokens_match: bool


def sweep_workload(model, name, lengths, cost_model, args, slots=None) -> SweepRow:
    """Our three routes through ``Rollout``, interleaved; ``slots`` is ``continuous_batch_size``."""
    device = next(model.parameters()).device
    ids, mask = left_padded(lengths, model.config.vocab_size, device, seed=1)
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=0.0, continuous_batch_size=slots)
    engines = {route: Rollout(model, NO_EOS, RolloutConfig(route=route, routing=RoutingConfig(cost_model=cost_model)))
               for route in ("ordinary", "continuous", "auto")}
    candidates = {route: (lambda ro=ro: ro.generate(RolloutRequest(ids, mask), sampling))
                  for route, ro in engines.items()}
    outputs = {route: fn() for route, fn in candidates.items()}  # warm-up, and the outputs compared
    times = {route: [] for route in candidates}
    for _ in range(args.repeats):  # interleaved: A B C A B C ...
        for route, fn in candidates.items():
            times[route].append(timed_ms(fn, device, 1, warmup=0))
    ms = {route: statistics.mean(values) for route, values in times.items()}
    stats = engines["auto"].last_stats
    auto_route = stats.route + (f"+{stats.prefill.buckets} buckets" if stats.prefill.buckets > 1 else "")
    return SweepRow(name + (f" ({slots} slots)" if slots else ""), auto_route, stats.prefill.buckets,
                    ms["ordinary"], ms["continuous"], ms["auto"],
                    # with a slot bound only the continuous route honours it: that is the manual route to beat
                    ms["auto"] / (ms["continuous"] if slots else min(ms["ordinary"], ms["continuous"])),
                    all(torch.equal(outputs[r].input_ids, outputs["ordinary"].input_ids) for r in outputs))


def sweep(args, model, device, dtype) -> list[SweepRow]:
    ignore = tuple(k for k in (args.ignore_metadata or "").split(",") if k)
    cost_model = load_cost_model(args.cost_config, model, device, dtype, ignore=ignore)
    workloads = WORKLOADS[args.workloads or ("small" if args.model == "tiny" else "seed004")]
    limit = model.config.max_position_embeddings - args.max_new_tokens
    rows = [sweep_workload(model, name, lengths, cost_model, args) for name, lengths in workloads.items()
            if max(lengths) <= limit]
    # fewer slots than rows: Auto must take the continuous route (the only one that honours the bound)
    name, lengths = next((n, l) for n, l in workloads.items() if max(l) <= limit and len(l) > 2)
    rows.append(sweep_workload(model, name, lengths, cost_model, args, slots=max(1, len(lengths) // 4)))
    print("| workload | Auto route | buckets | ordinary ms | continuous ms | Auto ms | Auto / best | same tokens |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r.workload} | {r.auto_route} | {r.auto_buckets} | {r.ordinary_ms:.2f} | {r.continuous_ms:.2f} | "
              f"{r.auto_ms:.2f} | {r.auto_over_best:.4f}x | {r.tokens_match} |")
    worst = max(rows, key=lambda r: r.auto_over_best)
    print(f"worst regression: {100 * (worst.auto_over_best - 1):+.3f}% ({worst.workload}); Auto chose "
          f"{sorted({r.auto_route for r in rows})}")
    missing = {"ordinary", "continuous"} - {r.auto_route.split("+")[0] for r in rows}
    if missing:
        print(f"note: Auto never chose {sorted(missing)} on these workloads")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=2)
    return rows


def _ints(text: str) -> list[int]:
    return [int(x) for x in str(text).split(",") if x]


def _positive_list(text: str) -> str:
    """An argparse ``type``: a comma list of ints >= 1 in ASCII digits (``int()`` reads '٣' as 3), kept as text."""
    if not all((parse_int_text(x) or 0) >= 1 for x in text.split(",")):
        raise argparse.ArgumentTypeError(f"must be a comma list of ints >= 1; got {text!r}")
    return text


def _shapes(text: str) -> str:
    """An argparse ``type``: ``BxL,...`` shapes, each a pair of ints >= 1 (ASCII digits), kept as text."""
    if not all(len(s.split("x")) == 2 and all((parse_int_text(v) or 0) >= 1 for v in s.split("x"))
               for s in text.split(",")):
        raise argparse.ArgumentTypeError(f"must be BxL,... shapes of ints >= 1; got {text!r}")
    return text


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(GRIDS), default="tiny",
                        help="tiny random Qwen2, or the random Qwen2.5-3B shape (rollout.testing.QWEN25_3B_SHAPE)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"), help="attention implementation")
    parser.add_argument("--batches", type=_positive_list, help="comma-separated batch sizes of the grid (default per --model)")
    parser.add_argument("--lengths", type=_positive_list, help="comma-separated prompt lengths of the grid (default per --model)")
    parser.add_argument("--decode-shapes", type=_shapes, help="BxL,... shapes of the decode measurement")
    parser.add_argument("--decode-steps", type=int_at_least(1), help="extra decode steps measured")
    parser.add_argument("--max-tokens", type=int_at_least(1), default=65536, help="skip grid shapes with B*L above this")
    parser.add_argument("--threads", type=int_at_least(1), default=1,
                        help="CPU threads for torch on --device cpu (1: stable timings on a shared machine)")
    parser.add_argument("--repeats", type=int_at_least(1), default=5, help="timed calls per cell (median; sweep: mean)")
    parser.add_argument("--output", type=out_path, default="prefill_calibration.json")
    parser.add_argument("--sweep", action="store_true", help="evaluate Auto with --cost-config instead")
    parser.add_argument("--cost-config", help="calibration JSON for --sweep")
    parser.add_argument("--ignore-metadata", help="comma-separated metadata keys not to check (e.g. source_sha256)")
    parser.add_argument("--workloads", choices=sorted(WORKLOADS), help="default: small (tiny), seed004 (3b)")
    parser.add_argument("--max-new-tokens", type=int_at_least(1), default=4, help="response budget of the sweep (EOS off)")
    parser.add_argument("--json", type=out_path, help="also write the sweep rows here")
    args = parser.parse_args(argv)
    if args.sweep and not args.cost_config:
        parser.error("--sweep needs --cost-config")
    return args


def main(argv=None):
    args = parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    model = build_model(args.model, args.device, dtype, args.attn)
    if args.sweep:
        return sweep(args, model, device, dtype)
    return calibrate(args, model, device, dtype)


if __name__ == "__main__":
    main()

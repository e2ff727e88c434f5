"""The sampler on the GPU, before and after the sort-free nucleus: the previous implementation (a copy,
below), the new eager function (the fallback: it still sorts) and the new compiled sampler, each call
captured in a CUDA graph after two warm-up runs; median ms of ``--iters`` replays (CUDA events). Also
checks that the new tokens equal the old ones on the same logits, seeds and steps, and the compiled
log-probabilities against the eager ``sampled_logprobs``. Prints one table; ``--json`` writes the result file
(rewritten after every row count, so a time limit keeps what ran).

  python -m benchmarks.sampler                      # rows 32 and 256, vocab 151936, bf16 logits
  python -m benchmarks.sampler --rows 256 --old-compiled --json out.json
  python -m benchmarks.sampler --rows 8 256 --kernel-configs 2048x8 512x4   # the fused kernel's tiles
  python -m benchmarks.sampler --rows 8 256 --chunk-configs 8192x2048x8x16 4096x1024x4x8   # rows cut in chunks

Compiling takes a while on the first call of each sampler (greedy, T=1, top-p, each with and without
log-probs); ``--cases`` runs a subset.
"""

from __future__ import annotations

import argparse
import sys
import types
from dataclasses import dataclass
from typing import Optional

import torch

from benchmarks.harness import results
from benchmarks.harness.cli import int_at_least, int_tuple, out_path
from benchmarks.harness.device import graph_ms
from benchmarks.harness.meta import header, run_meta
from benchmarks.harness.table import fmt, markdown_table
from rollout.config import SamplingConfig
from rollout.ops import fused_nucleus
from rollout.ops.sampling import Sampler, sampled_logprobs, sampler_key, select_next_token


# ----------------------------------------------------------------------------- the previous implementation
# The sampler as of commit b8f0f0e (before the sort-free nucleus), kept as the before/after baseline and
# as the oracle of tests/test_sampling.py. ``stable`` (not in the original) sorts ties in index order. Its noise is
# not capped below 1 (``rollout.ops.sampling.UNIFORM_MAX``): where a variate was 1.0 it draws that token, so today's
# tokens differ from it there (about one row in 220 a step at 151,936 tokens).

def _old_hash32(x):
    x = x & 0xFFFFFFFF
    x = ((x >> 16) ^ x) * 0x45D9F3B & 0xFFFFFFFF
    x = ((x >> 16) ^ x) * 0x45D9F3B & 0xFFFFFFFF
    return (x >> 16) ^ x


def _old_noise(seed, rows, step, vocab_size):
    base = _old_hash32(_old_hash32(seed ^ (rows * (0x9E3779B1 & 0x7FFFFFF))) ^ (step * (0x85EBCA6B & 0x7FFFFFF)))
    ids = torch.arange(vocab_size, device=rows.device, dtype=torch.long)
    bits = _old_hash32(base[:, None] ^ (ids[None, :] * 0x45D9F3B))
    return (bits.float() + 0.5) * (1.0 / 4294967296.0)


def old_top_p(logits, top_p, stable=False):
    if top_p >= 1.0:
        return logits
    sorted_logits, sorted_idx = torch.sort(logits, descending=False, dim=-1, stable=stable)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= (1.0 - top_p)
    remove_sorted[..., -1] = False
    remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def old_select(logits, sampling, seen, seed, rows, step, stable=False):
    scores = logits.float()
    if seen is not None:
        penalised = torch.where(scores < 0, scores * sampling.repetition_penalty,
                                scores / sampling.repetition_penalty)
        scores = torch.where(seen, penalised, scores)
    if sampling.is_greedy:
        return scores.argmax(dim=-1)
    scores = scores / sampling.temperature
    if 0 < sampling.top_k < scores.shape[-1]:
        kth = torch.topk(scores, sampling.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    scores = old_top_p(scores, sampling.top_p, stable)
    gumbel = -torch.log(-torch.log(_old_noise(seed, rows, step, scores.shape[-1])))
    return (scores + gumbel).argmax(dim=-1)


# ----------------------------------------------------------------------------- the benchmark

CASES = {
    "greedy": (dict(temperature=0.0), "random"),
    "T=1": (dict(temperature=1.0), "random"),
    "T=1 top-p 0.9": (dict(temperature=1.0, top_p=0.9), "random"),
    "T=1 top-p 0.9 peaked": (dict(temperature=1.0, top_p=0.9), "peaked"),
    "T=0.7 top-p 0.9": (dict(temperature=0.7, top_p=0.9), "random"),
}
RANDOM_SCALE = 3.0
"""Logits ~ N(0, 3^2), as in ``benchmarks.decode_step``."""
TRIALS = ((0, 1), (12345, 17), (2**32 - 1, 200))
"""(seed, step) pairs of the token checks."""


@dataclass
class SamplerRow:
    rows: int
    case: str
    variant: str
    ms: Optional[float]
    """Median ms of one replay; None where the variant failed."""
    median_nucleus: int
    """Median tokens kept by top-k/top-p (the vocabulary without them)."""
    tokens_equal_old: str
    """``equal/total`` tokens over the (seed, step) trials, against the previous implementation."""
    note: str = ""


def make_logits(rows: int, vocab: int, kind: str, top_p: float) -> tuple[torch.Tensor, float]:
    """bf16 logits: ``random`` (N(0, 3^2)) or ``peaked`` (the smallest scale whose median top-p nucleus
    is <= 1k tokens)."""
    gen = torch.Generator(device="cuda").manual_seed(rows)
    base = torch.randn(rows, vocab, device="cuda", generator=gen)
    if kind == "random":
        return (base * RANDOM_SCALE).bfloat16(), RANDOM_SCALE
    for scale in (4.0, 5.0, 6.0, 7.0, 8.0, 10.0, 12.0, 16.0, 24.0):
        logits = (base * scale).bfloat16()
        if nucleus_sizes(logits, top_p).median().item() <= 1000:
            return logits, scale
    return logits, scale


def nucleus_sizes(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    return (old_top_p(logits.float(), top_p, stable=True) > float("-inf")).sum(dim=-1)


def token_check(fn, logits: torch.Tensor, sampling: SamplingConfig) -> str:
    equal = total = 0
    ids = torch.arange(logits.shape[0], device="cuda")
    for seed, step in TRIALS:
        args = (torch.tensor(seed, device="cuda"), ids, torch.tensor(step, device="cuda"))
        old = old_select(logits, sampling, None, *args, stable=True)
        equal += int((fn(logits, *args) == old).sum())
        total += old.numel()
    return f"{equal}/{total}"


_OLD_COMPILED: list = []
_SKIP_COMPILED = False  # --skip-compiled: Inductor's compile of the search takes ~30 s a case


_KNOBS = ("BLOCK", "NUM_WARPS", "ARITY", "WIDE_ARITY")
_CHUNK_KNOBS = ("CHUNK_TOKENS", "SPLIT_BLOCK", "SPLIT_WARPS", "SPLIT_ARITY", "CHUNKS_PER_PROGRAM")


def _with_knobs(sampler, knobs: dict, with_logprobs):
    """A call of ``sampler`` with ``fused_nucleus``'s module knobs set to ``knobs`` for its duration."""
    def call(lg, s, r, t):
        saved = {k: getattr(fused_nucleus, k) for k in knobs}
        for knob, value in knobs.items():
            setattr(fused_nucleus, knob, value)
        try:
            return sampler(lg, None, s, r, t, with_logprobs)[0]
        finally:
            for knob, value in saved.items():
                setattr(fused_nucleus, knob, value)
    return call


def _with_config(sampler, config, with_logprobs):
    """A call of ``sampler``'s one-program-per-row kernel with its ``(BLOCK, NUM_WARPS[, ARITY])`` set to
    ``config`` (None: as is; an arity is used at every row count: ``ARITY`` and ``WIDE_ARITY``)."""
    knobs = dict(zip(_KNOBS, tuple(config or ()) + tuple(config or ())[2:]))  # an arity sets both
    return _with_knobs(sampler, {**knobs, "CHUNK_TOKENS": 0}, with_logprobs)


def variants(sampling: SamplingConfig, old_compiled: bool, kernel_configs=(), chunk_configs=()):
    """``(name, fn(logits, seed, rows, step) -> tokens, sampler or None)``."""
    key = sampler_key(sampling)
    compiled = Sampler(key, compiled=True, fused=False)  # the sort-free search, compiled by Inductor
    fused = Sampler(key, compiled=True)  # the one-kernel nucleus where it applies (top-p, no top-k)
    out = [
        ("old (eager, sort)", lambda lg, s, r, t: old_select(lg, sampling, None, s, r, t), None),
        ("new eager (fallback)", lambda lg, s, r, t: select_next_token(lg, sampling, None, s, r, t), None),
    ]
    if not _SKIP_COMPILED:
        out += [("compiled search", lambda lg, s, r, t: compiled(lg, None, s, r, t, False)[0], compiled),
                ("compiled search + logprobs", lambda lg, s, r, t: compiled(lg, None, s, r, t, True)[0], compiled)]
    if fused.is_fused:
        out.append(("fused kernel (default)", _with_knobs(fused, {}, False), fused))
        out.append(("fused kernel (default) + logprobs", _with_knobs(fused, {}, True), fused))
        out.append(("fused kernel, a program per row", _with_config(fused, None, False), fused))
        out.append(("fused kernel, a program per row + logprobs", _with_config(fused, None, True), fused))
        for config in kernel_configs:
            label = f"{config[0]}x{config[1]}w" + (f" arity {config[2]}" if len(config) > 2 else "")
            out.append((f"fused kernel, a program per row, {label}", _with_config(fused, config, False), fused))
        for config in chunk_configs:
            label = f"chunks of {config[0]}, {config[1]}x{config[2]}w" + (
                f" arity {config[3]}" if len(config) > 3 else "") + (
                f", {config[4]} a program" if len(config) > 4 else "")
            knobs = dict(zip(_CHUNK_KNOBS, config))
            if "SPLIT_ARITY" in knobs:  # at every row count
                knobs["SPLIT_WIDE_ARITY"] = knobs["SPLIT_WIDEST_ARITY"] = knobs["SPLIT_ARITY"]
            out.append((f"fused kernel, {label}", _with_knobs(fused, knobs, False), fused))
    if old_compiled:  # a code object per case: dynamo's recompile limit counts per code object
        code = old_select.__code__.replace(co_name=f"old_select_{len(_OLD_COMPILED)}")
        fresh = types.FunctionType(code, old_select.__globals__, code.co_name, old_select.__defaults__)
        fn = torch.compile(fresh, fullgraph=True, dynamic=False)
        _OLD_COMPILED.append(fn)
        out.append(("old compiled", lambda lg, s, r, t: fn(lg, sampling, None, s, r, t), None))
    return out


def logprob_error(sampler, logits: torch.Tensor, sampling: SamplingConfig) -> float:
    """Max |sampler - eager| log-probability of the sampler's own tokens."""
    ids = torch.arange(logits.shape[0], device="cuda")
    seed, step = torch.tensor(3, device="cuda"), torch.tensor(4, device="cuda")
    tokens, logprobs = sampler(logits, None, seed, ids, step, True)
    return float((logprobs - sampled_logprobs(logits, sampling, None, tokens)).abs().max())


def bench_case(rows: int, vocab: int, case: str, iters: int, old_compiled: bool,
               kernel_configs=(), chunk_configs=()) -> list[SamplerRow]:
    kwargs, kind = CASES[case]
    sampling = SamplingConfig(max_new_tokens=8, **kwargs)
    logits, scale = make_logits(rows, vocab, kind, sampling.top_p)
    median_nucleus = int(nucleus_sizes(logits, sampling.top_p).median()) if not sampling.is_greedy else 1
    ids = torch.arange(rows, device="cuda")
    seed, step = torch.tensor(7, device="cuda"), torch.tensor(3, device="cuda")
    out = []
    for name, fn, sampler in variants(sampling, old_compiled, kernel_configs, chunk_configs):
        note = f"scale {scale:g}"
        try:
            ms = graph_ms(lambda fn=fn: fn(logits, seed, ids, step), iters)
            equal = token_check(fn, logits, sampling)
        except Exception as exc:  # noqa: BLE001 - a variant that fails is reported, not fatal
            ms, equal, note = None, "-", f"failed: {exc!r:.160}"
        if sampler is not None and sampler.fallback_reason:
            note = f"FELL BACK: {sampler.fallback_reason:.200}"
        elif name.endswith("+ logprobs") and ms is not None:
            note += f"; path {sampler.last_path}; max |logprob - eager| {logprob_error(sampler, logits, sampling):.2e}"
        out.append(SamplerRow(rows, case, name, ms, median_nucleus, equal, note))
    return out


def kernel_defaults() -> str:
    return (f"fused kernel defaults {fused_nucleus.BLOCK}x{fused_nucleus.NUM_WARPS}w arity {fused_nucleus.ARITY}/"
            f"{fused_nucleus.WIDE_ARITY} a program per row; chunks of {fused_nucleus.CHUNK_TOKENS}, "
            f"{fused_nucleus.SPLIT_BLOCK}x{fused_nucleus.SPLIT_WARPS}w arity {fused_nucleus.SPLIT_ARITY}/"
            f"{fused_nucleus.SPLIT_WIDE_ARITY}/{fused_nucleus.SPLIT_WIDEST_ARITY}, {fused_nucleus.CHUNKS_PER_PROGRAM} "
            "a program")


def format_rows(rows: list[SamplerRow]) -> str:
    return markdown_table(["rows", "case", "variant", "ms", "median nucleus", "tokens = old", "note"],
                          [[r.rows, r.case, r.variant, fmt(r.ms), r.median_nucleus, r.tokens_equal_old, r.note]
                           for r in rows])


def main(argv=None) -> list[SamplerRow]:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sampler", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int_at_least(1), nargs="+", default=[32, 256])
    parser.add_argument("--vocab", type=int_at_least(2), default=151936)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--iters", type=int_at_least(1), default=50)
    parser.add_argument("--old-compiled", action="store_true", help="also torch.compile the previous implementation")
    parser.add_argument("--kernel-configs", type=int_tuple(2, 3, sep="x"), nargs="*", default=[],
                        help="extra BLOCKxWARPS[xARITY] configs of the one-program-per-row kernel, e.g. 2048x8 512x4x8")
    parser.add_argument("--chunk-configs", type=int_tuple(3, 4, 5, sep="x"), nargs="*", default=[],
                        help="extra TOKENSxBLOCKxWARPS[xARITY[xPER_PROGRAM]] configs of the chunked kernels, e.g. "
                             "8192x2048x8x16; a fifth field fixes the chunks per program")
    parser.add_argument("--skip-compiled", action="store_true", help="leave out the compiled search variants")
    parser.add_argument("--json", type=out_path, help="write the result file here")
    args = parser.parse_args(argv)
    configs, chunk_configs = args.kernel_configs, args.chunk_configs
    global _SKIP_COMPILED
    _SKIP_COMPILED = args.skip_compiled
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.sampler needs a CUDA device")
    meta = run_meta("sampler", argv, "cuda", vocab=args.vocab, iters=args.iters, kernel_defaults=kernel_defaults())
    print(f"{header(meta)}; vocab {args.vocab}, bf16 logits, each call captured in a CUDA graph, median of "
          f"{args.iters} replays; {kernel_defaults()}", flush=True)
    rows: list[SamplerRow] = []
    for count in args.rows:
        for case in args.cases:
            rows += bench_case(count, args.vocab, case, args.iters, args.old_compiled, configs, chunk_configs)
            print(f"  rows {count}, {case}: done", flush=True)
        if args.json:
            results.write(args.json, meta, rows)
    print(format_rows(rows))
    return rows


if __name__ == "__main__":
    main()

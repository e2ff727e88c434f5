#!/usr/bin/env python
"""Instrumentation overhead on rollout end to end (not a test).

Candidates, interleaved (A B C D A B C D ...), median of ``--repeats`` ``generate`` calls:

- ``none``: the rollout with the instrumentation calls replaced by a bare ``nullcontext`` (what a build
  without instrumentation would cost);
- ``unset``: ``OPSD_PROFILE`` unset (the shared do-nothing range);
- ``nvtx``: ``OPSD_PROFILE=nvtx`` (NVTX ranges; no tool attached);
- ``1-outside``: ``OPSD_PROFILE=1`` inside a profiler session, on steps that are not recorded.

  python scripts/bench_overhead_rollout.py                      # tiny model, CPU
  python scripts/bench_overhead_rollout.py --model 3b           # the Qwen2.5-3B shape, CUDA, bf16
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import rollout.engine as engine_module  # noqa: E402
from instrumentation import ProfileConfig, configure, opsd_profiler  # noqa: E402
from instrumentation.ranges import stage as real_stage  # noqa: E402
from rollout import Rollout, RolloutRequest, SamplingConfig  # noqa: E402
from rollout.testing import TinyTokenizer, random_prompts  # noqa: E402
from scripts.bench_rollout import build_model  # noqa: E402

_NULL = contextlib.nullcontext()


def _no_stage(name):
    return _NULL


@contextlib.contextmanager
def _no_collect():
    yield None


@contextlib.contextmanager
def candidate(name: str, trace_dir: str):
    """Set up one candidate's instrumentation around a block of calls."""
    real_collect = engine_module.collect_stages
    if name == "none":
        engine_module.stage, engine_module.collect_stages = _no_stage, _no_collect
        configure(ProfileConfig(mode="0"))
        try:
            yield
        finally:
            engine_module.stage, engine_module.collect_stages = real_stage, real_collect
        return
    if name == "1-outside":
        config = ProfileConfig(mode="1", output_dir=trace_dir, steps=(10**9,))
        with opsd_profiler(config):  # a session whose recorded step never comes
            yield
        return
    configure(ProfileConfig(mode={"unset": "0", "nvtx": "nvtx"}[name]))
    yield


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["tiny", "3b"], default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    model_name = args.model or ("3b" if args.device.startswith("cuda") else "tiny")
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = build_model(model_name, dtype, args.device)
    ro = Rollout(model, TinyTokenizer(pad_token_id=0, eos_token_id=None))
    ids, mask = random_prompts(args.batch_size, args.prompt_len, min_len=args.prompt_len,
                               vocab_size=model.config.vocab_size, device=args.device)
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=1.0, top_p=0.9,
                              n_samples_per_prompt=args.samples, seed=0)
    names = ["none", "unset", "nvtx", "1-outside"]
    times = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as trace_dir:
        for n in names:  # warm-up (captures graphs once)
            with candidate(n, trace_dir):
                ro.generate(RolloutRequest(ids, mask), sampling)
        for _ in range(args.repeats):
            for n in names:
                with candidate(n, trace_dir):
                    if args.device.startswith("cuda"):
                        torch.cuda.synchronize()
                    start = time.perf_counter()
                    ro.generate(RolloutRequest(ids, mask), sampling)
                    if args.device.startswith("cuda"):
                        torch.cuda.synchronize()
                    times[n].append((time.perf_counter() - start) * 1000.0)
    base = statistics.median(times["none"])
    print(f"# rollout E2E overhead, {model_name} on {args.device}, torch {torch.__version__}, B={args.batch_size} "
          f"n={args.samples} prompt={args.prompt_len} new={args.max_new_tokens}, median of {args.repeats}")
    print("| candidate | median E2E ms | vs none |")
    print("|---|---:|---:|")
    for n in names:
        med = statistics.median(times[n])
        print(f"| {n} | {med:.3f} | {100.0 * (med - base) / base:+.2f} % |")


if __name__ == "__main__":
    main()

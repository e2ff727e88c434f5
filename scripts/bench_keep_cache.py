#!/usr/bin/env python
"""Effect of ``RolloutConfig.keep_cache`` on the training step's peak memory (not a test).

With ``keep_cache=True`` the rollout keeps its KV cache (and, for the fast decoder, its static decode
buffers and CUDA graphs) allocated between calls, so it is resident during the teacher forward, the
student forward and backward — where a training step peaks. With ``False`` all of it is released at
the end of each rollout. This script measures ``Rollout.held_bytes`` after a rollout for both
settings — exactly what a kept cache adds to the rest of the step — and, on CUDA, the allocator's
peak during a student forward + backward that runs after the rollout.

  python scripts/bench_keep_cache.py                       # tiny model, CPU
  python scripts/bench_keep_cache.py --model 3b            # the Qwen2.5-3B shape, CUDA, bf16
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rollout import Rollout, RolloutConfig, RolloutRequest, SamplingConfig  # noqa: E402
from rollout.testing import TinyTokenizer, random_prompts  # noqa: E402
from scripts.bench_rollout import build_model  # noqa: E402


def measure(model, keep: bool, ids, mask, sampling, device: str) -> dict:
    ro = Rollout(model, TinyTokenizer(pad_token_id=0, eos_token_id=None), RolloutConfig(keep_cache=keep))
    batch = ro.generate(RolloutRequest(ids, mask), sampling)
    row = {"held_mib": ro.held_bytes / 2**20, "step_peak_mib": None, "allocated_mib": None}
    if device.startswith("cuda"):  # the training half of a step, with whatever the rollout still holds
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        row["allocated_mib"] = torch.cuda.memory_allocated() / 2**20  # before the forward
        with torch.autocast("cuda", dtype=torch.bfloat16):
            # the last position's logits only: full-vocabulary logits of every position would dwarf the cache
            loss = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                         logits_to_keep=1).logits.float().mean()
        loss.backward()
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        row["step_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    ro.shutdown()
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["tiny", "3b"], default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=2, help="measurements per setting (alternating)")
    args = parser.parse_args(argv)
    model_name = args.model or ("3b" if args.device.startswith("cuda") else "tiny")
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = build_model(model_name, dtype, args.device)
    ids, mask = random_prompts(args.batch_size, args.prompt_len, min_len=args.prompt_len // 2,
                               vocab_size=model.config.vocab_size, device=args.device)
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=0,
                              n_samples_per_prompt=args.samples)
    # alternating settings, so that whatever the first measurement of the process leaves behind (lazily
    # allocated workspaces, compiled code) does not count against one setting only
    order = [keep for _ in range(args.rounds) for keep in (True, False)]
    rows = [(keep, measure(model, keep, ids, mask, sampling, args.device)) for keep in order]
    print(f"# keep_cache, {model_name} {dtype} on {args.device}, torch {torch.__version__}: B={args.batch_size} "
          f"n={args.samples} prompt={args.prompt_len} new={args.max_new_tokens}; settings alternate, in this order")
    print("| keep_cache | held by the rollout after the call (MiB) | allocated before forward+backward (MiB) "
          "| peak of forward+backward (MiB) |")
    print("|---|---:|---:|---:|")
    for keep, row in rows:
        if row["step_peak_mib"] is None:
            before = peak = "n/a (no allocator on CPU)"
        else:
            before, peak = f"{row['allocated_mib']:.1f}", f"{row['step_peak_mib']:.1f}"
        print(f"| {keep} | {row['held_mib']:.2f} | {before} | {peak} |")


if __name__ == "__main__":
    main()

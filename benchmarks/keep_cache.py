"""Effect of ``RolloutConfig.keep_cache`` on the training step's peak memory (not a test).

With ``keep_cache=True`` the rollout keeps its KV cache (and, for the fast decoder, its static decode
buffers and CUDA graphs) allocated between calls, so it is resident during the teacher forward, the
student forward and backward — where a training step peaks. With ``False`` all of it is released at
the end of each rollout. This measures ``Rollout.held_bytes`` after a rollout for both settings — exactly
what a kept cache adds to the rest of the step — and, on CUDA, the allocator's peak during a student
forward + backward that runs after the rollout. The settings alternate in the harness's rounds (True
False, False True, ...), so whatever the first measurement of the process leaves behind (lazily allocated
workspaces, compiled code) does not count against one setting only.

  python -m benchmarks.keep_cache                       # tiny model, CPU
  python -m benchmarks.keep_cache --model 3b            # the Qwen2.5-3B shape, CUDA, bf16
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Optional

import torch

from benchmarks.harness import results
from benchmarks.harness.cli import int_at_least, out_path
from benchmarks.harness.meta import header, run_meta
from benchmarks.harness.models import add_model_args, load_model
from benchmarks.harness.rounds import Rounds, run_rounds
from benchmarks.harness.table import fmt, markdown_table
from rollout import Rollout, RolloutConfig, RolloutRequest, SamplingConfig
from rollout.testing import TinyTokenizer, random_prompts


@dataclass
class KeepCacheRow:
    keep_cache: bool
    round: int
    held_mib: float
    """``Rollout.held_bytes`` after the call."""
    allocated_mib: Optional[float] = None
    """Allocated before the student forward + backward (CUDA)."""
    step_peak_mib: Optional[float] = None
    """Peak of the student forward + backward (CUDA)."""


def measure(model, keep: bool, prompts: tuple, sampling: SamplingConfig, device: str) -> dict:
    ro = Rollout(model, TinyTokenizer(pad_token_id=0, eos_token_id=None), RolloutConfig(keep_cache=keep))
    batch = ro.generate(RolloutRequest(*prompts), sampling)
    row = {"held_mib": ro.held_bytes / 2**20}
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


def main(argv=None) -> list[KeepCacheRow]:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.keep_cache", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--batch-size", type=int_at_least(1), default=4)
    parser.add_argument("--samples", type=int_at_least(1), default=4)
    parser.add_argument("--prompt-len", type=int_at_least(2), default=512)
    parser.add_argument("--max-new-tokens", type=int_at_least(1), default=512)
    parser.add_argument("--rounds", type=int_at_least(1), default=2, help="measurements per setting (alternating)")
    parser.add_argument("--json", type=out_path, help="write the result file here")
    args = parser.parse_args(argv)
    loaded = load_model(args)
    prompts = random_prompts(args.batch_size, args.prompt_len, min_len=args.prompt_len // 2,
                             vocab_size=loaded.model.config.vocab_size, device=args.device)
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=0,
                              n_samples_per_prompt=args.samples)
    rows: list[KeepCacheRow] = []
    done = {True: 0, False: 0}

    def call(keep, seed, timed):
        rows.append(KeepCacheRow(keep, done[keep], **measure(loaded.model, keep, prompts, sampling, args.device)))
        done[keep] += 1

    run_rounds([True, False], Rounds(args.rounds, warmup=0), call)
    meta = run_meta("keep_cache", argv, args.device, model=loaded.name, dtype=str(loaded.dtype),
                    batch_size=args.batch_size, samples=args.samples, prompt_len=args.prompt_len,
                    max_new_tokens=args.max_new_tokens)
    print(f"{header(meta)}; {loaded.name} {loaded.dtype}: B={args.batch_size} n={args.samples} "
          f"prompt={args.prompt_len} new={args.max_new_tokens}; rows in the order they ran")
    cpu = "n/a (no allocator on CPU)"
    print(markdown_table(
        ["keep_cache", "held by the rollout after the call (MiB)", "allocated before forward+backward (MiB)",
         "peak of forward+backward (MiB)"],
        [[r.keep_cache, fmt(r.held_mib, ".2f"), fmt(r.allocated_mib, ".1f") if r.step_peak_mib is not None else cpu,
          fmt(r.step_peak_mib, ".1f") if r.step_peak_mib is not None else cpu] for r in rows]))
    if args.json:
        results.write(args.json, meta, rows)
    return rows


if __name__ == "__main__":
    main()

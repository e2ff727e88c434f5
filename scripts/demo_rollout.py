#!/usr/bin/env python
"""A short rollout on the embedded tiny model (CPU): prints shapes, a few tokens and tokens/s."""

from __future__ import annotations

import argparse
import time

import torch

from rollout import Rollout, RolloutRequest, SamplingConfig
from rollout.testing import TinyTokenizer, random_prompts, tiny_model


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4, help="n_samples_per_prompt")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.8)
    args = parser.parse_args(argv)

    model = tiny_model("qwen2", seed=0)
    tokenizer = TinyTokenizer(pad_token_id=0, eos_token_id=2)
    ids, mask = random_prompts(args.batch_size, args.prompt_len, min_len=args.prompt_len // 2, seed=0)
    rollout = Rollout(model, tokenizer)
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              n_samples_per_prompt=args.samples, seed=0)
    rollout.generate(RolloutRequest(ids, mask), sampling)  # warm-up
    start = time.perf_counter()
    batch = rollout.generate(RolloutRequest(ids, mask), sampling)
    elapsed = time.perf_counter() - start
    num_tokens = int(batch.attention_mask[:, args.prompt_len:].sum())
    print(f"prompts      {tuple(ids.shape)}  (left-padded, lengths {mask.sum(1).tolist()})")
    print(f"input_ids    {tuple(batch.input_ids.shape)}  attention_mask {tuple(batch.attention_mask.shape)}")
    print(f"response_start_idx {batch.response_start_idx.tolist()}")
    print(f"row 0 response: {batch.input_ids[0, args.prompt_len:args.prompt_len + 12].tolist()} ...")
    print(f"{num_tokens} response tokens in {elapsed * 1000:.1f} ms = {num_tokens / elapsed:.0f} tokens/s "
          f"(torch {torch.__version__}, CPU)")


if __name__ == "__main__":
    main()

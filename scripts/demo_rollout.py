#!/usr/bin/env python
"""A short rollout on the embedded tiny model (CPU): prints shapes, a few tokens and tokens/s.

Every flag is checked before the model is built, as the main job's are: a bad value exits with status 2 naming
the flag; prompts and responses past the model's context, or rows that cannot fit the host's available memory,
exit with status 1 and one ``error: --flag ...`` line.
"""

from __future__ import annotations

import argparse
import time

import torch

from rollout import Rollout, RolloutRequest, SamplingConfig
from rollout.checks import is_int, require
from rollout.opsd import preflight
from rollout.opsd.flags import JobParser
from rollout.plan.memory import GIB
from rollout.testing import TinyTokenizer, random_prompts, tiny_config, tiny_model

#: The embedded model the demo runs (``rollout.testing.TINY_SHAPES``).
ARCH = "qwen2"
#: The flag of each ``SamplingConfig`` field the demo sets: a refusal names the flag.
SAMPLING_FLAGS = {"max_new_tokens": "--max-new-tokens", "temperature": "--temperature",
                  "n_samples_per_prompt": "--samples"}


def sampling_config(args) -> SamplingConfig:
    """The demo's ``SamplingConfig`` and its other counts, checked by value (no model needed): ValueError naming
    the flag."""
    for flag, value in (("--batch-size", args.batch_size), ("--prompt-len", args.prompt_len)):
        require(is_int(value) and value >= 1, flag, f"must be an int >= 1; got {value!r}")
    try:
        return SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              n_samples_per_prompt=args.samples, seed=0)
    except ValueError as exc:
        field, _, reason = str(exc).partition(": ")
        raise ValueError(f"{SAMPLING_FLAGS.get(field, field)}: {reason}") from None


def check_model(args, model: preflight.ModelFacts, available_bytes) -> None:
    """The flags against the model's config and the host's available memory (None: unknown), before the model is
    built: ValueError naming the flags and the numbers."""
    preflight.check_context([("--prompt-len", args.prompt_len), ("--max-new-tokens", args.max_new_tokens)],
                            model.context, "the model's", f"max_position_embeddings of {model.name}")
    rows = args.batch_size * args.samples
    need = preflight.cache_need(rows, args.prompt_len, args.max_new_tokens, model, dtype_bytes=4)
    if available_bytes is not None and need.total_bytes > available_bytes:
        raise ValueError(f"--batch-size {args.batch_size} x --samples {args.samples} = {rows} rows: the rollout "
                         f"needs at least {need.total_bytes / GIB:.3g} GiB ({rows} rows x {need.columns} columns of "
                         f"KV cache and per-row buffers) but the host has {available_bytes / GIB:.3g} GiB available")


def parse_args(argv=None):
    """``(args, SamplingConfig)``, every flag checked before any model is built."""
    parser = JobParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # -inf: a value
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4, help="n_samples_per_prompt")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.8)
    args = parser.parse_args(argv)
    try:
        sampling = sampling_config(args)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        check_model(args, preflight.ModelFacts.of(f"the embedded tiny {ARCH} model", tiny_config(ARCH)),
                    preflight.available_bytes("cpu"))
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    return args, sampling


def main(argv=None) -> None:
    args, sampling = parse_args(argv)
    model = tiny_model(ARCH, seed=0)
    tokenizer = TinyTokenizer(pad_token_id=0, eos_token_id=2)
    ids, mask = random_prompts(args.batch_size, args.prompt_len, min_len=max(1, args.prompt_len // 2), seed=0)
    rollout = Rollout(model, tokenizer)
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

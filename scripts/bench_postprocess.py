#!/usr/bin/env python
"""Post-processing: per-row reference loop vs upstream-style loop vs our batched version.

Rows B*n in {16, 256, 2048} x sequence length T in {128, 1024} (prompt T/2, response budget T/2,
EOS at random positions in half of the rows). Candidates are interleaved; median of repeats.
Prints one markdown table; ``--json`` writes the rows too.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from rollout.ops.expand import expand_prompts
from rollout.ops.postprocess import postprocess, postprocess_reference

EOS, PAD, N_SAMPLES = (2,), 0, 4


def upstream_style(prompt_ids, prompt_mask, generated, n, eos_ids, pad):
    """The shape of DeepSpeed 0.19.8's post-processing (written here for comparison): vectorised
    EOS padding, then a mask from token values patched by a Python loop over rows for the prompt."""
    exp_ids = prompt_ids.repeat_interleave(n, 0)
    is_eos = torch.isin(generated, torch.tensor(eos_ids, device=generated.device))
    after = (is_eos.int().cumsum(1) - is_eos.int()) > 0
    response = generated.masked_fill(after, pad)
    out = torch.cat([exp_ids, response], 1)
    mask = (out != pad).long()
    mask[:, prompt_ids.shape[1]:] = (~after).long()
    for i in range(out.shape[0]):
        mask[i, :prompt_ids.shape[1]] = prompt_mask[i // n]
    return out, mask


@dataclass
class Row:
    rows: int
    seq_len: int
    device: str
    reference_ms: float
    upstream_style_ms: float
    batched_ms: float

    @property
    def speedup(self) -> float:
        return self.reference_ms / self.batched_ms


def _inputs(rows, seq_len, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    batch, prompt_len, width = rows // N_SAMPLES, seq_len // 2, seq_len // 2
    ids = torch.randint(3, 1000, (batch, prompt_len), generator=gen)
    lengths = torch.randint(1, prompt_len + 1, (batch,), generator=gen)
    mask = (torch.arange(prompt_len)[None] >= prompt_len - lengths[:, None]).long()
    ids = torch.where(mask.bool(), ids, PAD)
    generated = torch.randint(3, 1000, (rows, width), generator=gen)
    eos_rows = torch.randperm(rows, generator=gen)[: rows // 2]
    generated[eos_rows, torch.randint(0, width, (len(eos_rows),), generator=gen)] = EOS[0]
    return ids.to(device), mask.to(device), generated.to(device)


def _time(fn, device, repeats):
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def measure(rows, seq_len, device, repeats):
    ids, mask, generated = _inputs(rows, seq_len, device)
    exp_ids, exp_mask = expand_prompts(ids, mask, N_SAMPLES)
    fns = {
        "reference": lambda: postprocess_reference(ids, mask, generated, N_SAMPLES, EOS, PAD),
        "upstream_style": lambda: upstream_style(ids, mask, generated, N_SAMPLES, EOS, PAD),
        "batched": lambda: postprocess(exp_ids, exp_mask, generated, EOS, PAD),
    }
    ref, fast = fns["reference"](), fns["batched"]()
    assert torch.equal(ref.input_ids, fast.input_ids) and torch.equal(ref.attention_mask, fast.attention_mask)
    for fn in fns.values():  # warm-up
        fn()
    results = {name: [] for name in fns}
    for _ in range(repeats):  # interleaved: A B C A B C ...
        for name, fn in fns.items():
            results[name].append(_time(fn, device, 1))
    med = {name: statistics.median(v) for name, v in results.items()}
    return Row(rows, seq_len, device.type, med["reference"], med["upstream_style"], med["batched"])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    rows = [measure(r, t, device, args.repeats) for r in (16, 256, 2048) for t in (128, 1024)]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(f"# post-processing, {name}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"median of {args.repeats}, n_samples_per_prompt={N_SAMPLES}")
    print("| B*n | T | device | reference loop (ms) | upstream-style (ms) | batched (ms) | vs reference | vs upstream-style |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r.rows} | {r.seq_len} | {r.device} | {r.reference_ms:.3f} | {r.upstream_style_ms:.3f} | "
              f"{r.batched_ms:.3f} | {r.speedup:.1f}x | {r.upstream_style_ms / r.batched_ms:.1f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)


if __name__ == "__main__":
    main()

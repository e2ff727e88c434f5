"""Post-processing: per-row reference loop vs upstream-style loop vs our batched version.

Rows B*n in {16, 256, 2048} x sequence length T in {128, 1024} (prompt T/2, response budget T/2, EOS at random
positions in half of the rows). The three are checked equal first, then timed by the harness (a warm-up call
each, rounds alternating); median of ``--repeats``. One markdown table; ``--json`` writes the result file.

  python -m benchmarks.postprocess [--device cuda] [--repeats 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass

import torch

from benchmarks.harness import results
from benchmarks.harness.meta import header, run_meta
from benchmarks.harness.cli import int_at_least, out_path
from benchmarks.harness.models import default_device, device_arg
from benchmarks.harness.rounds import Rounds, Timer, time_rounds
from benchmarks.harness.table import markdown_table
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
class PostprocessRow:
    rows: int
    seq_len: int
    device: str
    reference_ms: float
    upstream_style_ms: float
    batched_ms: float


def _inputs(rows: int, seq_len: int, device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    batch, prompt_len, width = rows // N_SAMPLES, seq_len // 2, seq_len // 2
    ids = torch.randint(3, 1000, (batch, prompt_len), generator=gen)  # ids: [B, T_p]
    lengths = torch.randint(1, prompt_len + 1, (batch,), generator=gen)
    mask = (torch.arange(prompt_len)[None] >= prompt_len - lengths[:, None]).long()
    ids = torch.where(mask.bool(), ids, PAD)
    generated = torch.randint(3, 1000, (rows, width), generator=gen)  # generated: [B*n, T_r]
    eos_rows = torch.randperm(rows, generator=gen)[: rows // 2]
    generated[eos_rows, torch.randint(0, width, (len(eos_rows),), generator=gen)] = EOS[0]
    return ids.to(device), mask.to(device), generated.to(device)


def measure(rows: int, seq_len: int, device: torch.device, repeats: int) -> PostprocessRow:
    ids, mask, generated = _inputs(rows, seq_len, device)
    exp_ids, exp_mask = expand_prompts(ids, mask, N_SAMPLES)
    fns = {
        "reference": lambda: postprocess_reference(ids, mask, generated, N_SAMPLES, EOS, PAD),
        "upstream_style": lambda: upstream_style(ids, mask, generated, N_SAMPLES, EOS, PAD),
        "batched": lambda: postprocess(exp_ids, exp_mask, generated, EOS, PAD),
    }
    ref, fast = fns["reference"](), fns["batched"]()
    assert torch.equal(ref.input_ids, fast.input_ids) and torch.equal(ref.attention_mask, fast.attention_mask)
    med = {k: statistics.median(v) for k, v in time_rounds(fns, Rounds(repeats), Timer(str(device))).items()}
    return PostprocessRow(rows, seq_len, device.type, med["reference"], med["upstream_style"], med["batched"])


def main(argv=None) -> list[PostprocessRow]:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.postprocess", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", type=device_arg, default=default_device())
    parser.add_argument("--repeats", type=int_at_least(1), default=7)
    parser.add_argument("--json", type=out_path, help="also write the result file here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    rows = [measure(r, t, device, args.repeats) for r in (16, 256, 2048) for t in (128, 1024)]
    meta = run_meta("postprocess", argv, args.device, threads=torch.get_num_threads(), repeats=args.repeats,
                    n_samples_per_prompt=N_SAMPLES)
    print(f"{header(meta)}; {torch.get_num_threads()} threads, median of {args.repeats}, "
          f"n_samples_per_prompt={N_SAMPLES}")
    print(markdown_table(
        ["B*n", "T", "device", "reference loop (ms)", "upstream-style (ms)", "batched (ms)", "vs reference",
         "vs upstream-style"],
        [[r.rows, r.seq_len, r.device, f"{r.reference_ms:.3f}", f"{r.upstream_style_ms:.3f}", f"{r.batched_ms:.3f}",
          f"{r.reference_ms / r.batched_ms:.1f}x", f"{r.upstream_style_ms / r.batched_ms:.1f}x"] for r in rows]))
    if args.json:
        results.write(args.json, meta, rows)
    return rows


if __name__ == "__main__":
    main()

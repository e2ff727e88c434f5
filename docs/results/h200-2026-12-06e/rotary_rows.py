"""h200-2026-12-06e: where the rotary inside the attention kernel starts to pay. The routes' default decode step
(3B shape, bf16, 704 live columns, a CUDA graph, median of 10 replays) with the rotary and cache write inside the
attention at every row count (kernels.rotary_in_attention_rows=1) and apart at every row count (=0), in two rounds
(A B, B A) at each row count. Run from the repository root: python docs/results/h200-2026-12-06e/rotary_rows.py"""

import dataclasses
import sys

import torch

from benchmarks.decode_step.step import ROUTE_DEFAULT, StepVariant, time_steps
from rollout.testing import shaped_model

ROWS = [int(r) for r in sys.argv[1:]] or [8, 16, 24, 32, 48, 64]
model = shaped_model("qwen25-3b", dtype=torch.bfloat16, device="cuda")
steps = [StepVariant(dataclasses.replace(ROUTE_DEFAULT.kernels, rotary_in_attention_rows=n)) for n in (1, 0)]
print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
print("| rows | inside (=1) ms | apart (=0) ms | inside / apart |")
print("| ---: | --- | --- | ---: |")
for rows in ROWS:
    timed = time_steps(model, rows, 704, steps, 2)
    inside = [r["ms"] for r in timed if "from 1 rows" in r["variant"]]
    apart = [r["ms"] for r in timed if "rotary in the attention" not in r["variant"]]
    ratio = sum(inside) / sum(apart)
    print(f"| {rows} | {', '.join(f'{m:.3f}' for m in inside)} | {', '.join(f'{m:.3f}' for m in apart)} | {ratio:.3f} |",
          flush=True)

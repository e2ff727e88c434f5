"""h200-2026-12-06d: which tuned product slows the decode attention after it?

The routes' default decode step (random qwen25-3b shape, bf16, 256 rows, 704 live columns; one CUDA graph each) on
PyTorch's products (``cublaslt``), on the tuned ones (``cublaslt-tuned``), and on the tuned ones with one projection
left to PyTorch (q|k|v, o, gate|up or down). Each step is timed interleaved (A B C ..., then reversed; median of 10
replays a round), then profiled over 5 replays: per variant, the step's ms and each kernel's µs a layer. With
``REVERSE=1`` the variants are built (each its own random cache) in the reverse order.
"""
import collections
import dataclasses
import os
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.decode_step.step import ROUTE_DEFAULT, StepVariant, blas_backend, decode_step_fn
from benchmarks.harness.device import capture, print_tuned_plans
from instrumentation.probe import event_ms
from rollout.ops import tuned_gemm
from rollout.testing import shaped_model

ROWS, LIVE, ROUNDS, REPLAYS = 256, 704, 6, 5
#: (K, N) of each projection of the 3B shape: q|k|v, o, gate|up, down.
SHAPES = {"q|k|v": (2048, 2560), "o": (2048, 2048), "gate|up": (2048, 22016), "down": (11008, 2048)}
EXCLUDED = set()
_plan = tuned_gemm.TunedGemm._plan


def _plan_except(self, x, w, out, residual):
    if (x.shape[1], w.shape[0]) in EXCLUDED:
        return None
    return _plan(self, x, w, out, residual)


tuned_gemm.TunedGemm._plan = _plan_except


def main():
    model = shaped_model("qwen25-3b", dtype=torch.bfloat16, device="cuda")
    layers = model.config.num_hidden_layers
    variants = [("default", "cublaslt", None), ("tuned", "cublaslt-tuned", None)]
    variants += [(f"tuned, {name} PyTorch's", "cublaslt-tuned", name) for name in SHAPES]
    if os.environ.get("REVERSE"):  # capture (and allocate each variant's cache) in the other order
        variants = variants[::-1]
    graphs = {}
    for label, library, left in variants:
        EXCLUDED.clear()
        if left:
            EXCLUDED.add(SHAPES[left])
        with blas_backend(library):
            step = StepVariant(dataclasses.replace(ROUTE_DEFAULT.kernels, blas_library=library))
            graphs[label] = capture(decode_step_fn(model, ROWS, LIVE, step))
    EXCLUDED.clear()
    print_tuned_plans()
    times = collections.defaultdict(list)
    labels = list(graphs)
    for r in range(ROUNDS):
        for label in labels if r % 2 == 0 else labels[::-1]:
            times[label].append(statistics.median(event_ms(graphs[label].replay, 10, warmup=1)))
    kernels = {}
    for label in labels:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(REPLAYS):
                graphs[label].replay()
            torch.cuda.synchronize()
        kernels[label] = {e.key: e.device_time_total / REPLAYS / layers for e in prof.key_averages()}
    print(f"# {torch.cuda.get_device_name(0)}; torch {torch.__version__}; {ROWS} rows, {LIVE} live columns")
    print("| variant | step ms (median of 6 rounds; min-max) | attention µs a layer | top kernels, µs a layer |")
    print("|---|---|---:|---|")
    for label in labels:
        ks = kernels[label]
        att = sum(v for k, v in ks.items() if "decode_attention" in k)
        top = ", ".join(f"{k[:40]} {v:.1f}" for k, v in sorted(ks.items(), key=lambda kv: -kv[1])[:7])
        t = times[label]
        print(f"| {label} | {statistics.median(t):.3f} ({min(t):.3f}-{max(t):.3f}) | {att:.2f} | {top} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()

"""The decode attention (36 layers, 256 rows, bf16, the 3B shape: 16 query heads, 2 KV heads, head dim 128) over a
window of W columns read from KV storage C columns wide (a view [:, :, :W] of [256, 2, C, 128]), two rounds in
opposite orders, min / max of the rounds. Usage, from the repository root:
python docs/results/h200-2026-12-07b/stride_sweep.py W C1 C2 ... (C: a capacity, or a:b:s for range(a, b, s))"""

import sys

import torch

from benchmarks.harness.device import graph_ms
from rollout.ops import decode_attention

ROWS, KV, HEADS, DIM, LAYERS = 256, 2, 16, 128, 36


def capacities(args):
    for arg in args:
        if ":" in arg:
            yield from range(*map(int, arg.split(":")))
        else:
            yield int(arg)


def main(window: int, caps: list) -> None:
    print(torch.cuda.get_device_name(), torch.__version__)
    q = torch.randn(ROWS, HEADS, 1, DIM, device="cuda", dtype=torch.bfloat16)
    keep = torch.ones(ROWS, 1, 1, window, dtype=torch.bool, device="cuda")
    last = torch.tensor(window - 1, device="cuda")
    times = {}
    for r in range(2):
        for cap in (caps if r == 0 else caps[::-1]):
            k = torch.randn(ROWS, KV, cap, DIM, device="cuda", dtype=torch.bfloat16)[:, :, :window]
            v = torch.randn(ROWS, KV, cap, DIM, device="cuda", dtype=torch.bfloat16)[:, :, :window]
            fn = lambda k=k, v=v: decode_attention.attention(q, k, v, keep, DIM ** -0.5, True, last=last)  # noqa: E731
            times.setdefault(cap, []).append(graph_ms(fn, 10) * LAYERS)
            del k, v
    gb = ROWS * KV * window * DIM * 2 * 2 * LAYERS / 1e9
    best = min(min(t) for t in times.values())
    for cap, t in times.items():
        print(f"window {window} capacity {cap} ({cap / 64:g} x 64): {min(t):.3f} / {max(t):.3f} ms, "
              f"{gb / min(t) * 1e3:.0f} GB/s, {min(t) / best - 1:+.1%} on the best")


if __name__ == "__main__":
    main(int(sys.argv[1]), [c for c in capacities(sys.argv[2:]) if c >= int(sys.argv[1])])

"""h200-2026-12-06d: does split-K's float32 workspace cost the kernel after it a write-back?

36 distinct down weights (rows 256, K 11008, N 2048, the residual added in place: the decode step's down product at
256 rows), each product followed or not by a streaming read of 100 MB of its own (a stand-in for the layer's
attention over its keys and values), captured in CUDA graphs and timed interleaved. Variants of the product:
PyTorch's (``torch``), the tuner's pick (``tuned``: split-K on the H100, one workspace reused, as the step runs it)
and the same pick with its workspace moved to a fresh 32 MiB slot every layer (``tuned-rotated``: every layer's
partial sums in lines the L2 cache has not seen, as the tuner would time it if it counted the write-back).
Printed per layer, µs: the products alone, the reads alone, both, and what the read costs more next to the product
(both - product alone - read alone).
"""
import statistics
import sys

import torch

from rollout.ops import cublaslt, tuned_gemm

LAYERS, ROWS, K, N = 36, 256, 11008, 2048
READ_BYTES = 100 << 20
REPS, ROUNDS = 20, 7


def main():
    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    x = torch.randn(ROWS, K, device=dev, dtype=torch.bfloat16)
    ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * K ** -0.5 for _ in range(LAYERS)]
    h = torch.zeros(ROWS, N, device=dev, dtype=torch.bfloat16)
    kv = [torch.randn(READ_BYTES // 2, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)]
    acc = torch.zeros(LAYERS, device=dev, dtype=torch.float32)
    tuner = tuned_gemm.TunedGemm(0)
    tuner.addmm_(h, x, ws[0])
    print("\n".join(tuner.summary()))
    plan = next(iter(tuner.plans.values()))
    print("pick:", plan.chosen.source, plan.config)
    slots = torch.empty(LAYERS * cublaslt.WORKSPACE, device=dev, dtype=torch.uint8)

    def product(kind, i):
        if kind == "torch" or plan.algo is None:
            h.addmm_(x, ws[i].t())
        elif kind == "tuned":
            tuner.addmm_(h, x, ws[i])
        else:
            plan.product.launch(plan.algo, ws[i].data_ptr(), x.data_ptr(), h.data_ptr(),
                                slots.data_ptr() + i * cublaslt.WORKSPACE, torch.cuda.current_stream(dev).cuda_stream)

    def read(i):
        torch.sum(kv[i], dim=0, dtype=torch.float32, out=acc[i])

    def capture(fn):
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream(dev)
        s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s):
            g.capture_begin()
            fn()
            g.capture_end()
        torch.cuda.current_stream(dev).wait_stream(s)
        return g

    kinds = ["torch", "tuned", "tuned-rotated"]
    graphs = {"read": capture(lambda: [read(i) for i in range(LAYERS)])}
    for kind in kinds:
        graphs[kind] = capture(lambda kind=kind: [product(kind, i) for i in range(LAYERS)])
        graphs[kind + "+read"] = capture(lambda kind=kind: [(product(kind, i), read(i)) for i in range(LAYERS)])
    times = {name: [] for name in graphs}
    names = list(graphs)
    for r in range(ROUNDS):
        for name in (names if r % 2 == 0 else names[::-1]):
            g = graphs[name]
            g.replay()
            evs = []
            for _ in range(REPS):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                g.replay()
                b.record()
                evs.append((a, b))
            torch.cuda.synchronize()
            times[name].append(statistics.median(a.elapsed_time(b) for a, b in evs) * 1e3 / LAYERS)
    med = {name: statistics.median(v) for name, v in times.items()}
    spread = {name: (min(v), max(v)) for name, v in times.items()}
    print(f"# {torch.cuda.get_device_name(0)}; torch {torch.__version__}; µs per layer, median of {ROUNDS} rounds "
          f"(each the median of {REPS} replays)")
    print("| product | product alone | read alone | both | the read's extra next to the product |")
    print("|---|---:|---:|---:|---:|")
    for kind in kinds:
        extra = med[kind + "+read"] - med[kind] - med["read"]
        print(f"| {kind} | {med[kind]:.2f} ({spread[kind][0]:.2f}-{spread[kind][1]:.2f}) | {med['read']:.2f} | "
              f"{med[kind + '+read']:.2f} ({spread[kind + '+read'][0]:.2f}-{spread[kind + '+read'][1]:.2f}) | "
              f"{extra:+.2f} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()

"""Device measurements shared by the benchmarks: the rates the rooflines divide by, CUDA-graph replay timing.

The roofline formulas are in :mod:`instrumentation.roofline` (no torch); what they divide by is measured here.
"""

from __future__ import annotations

import statistics

import torch

from benchmarks.harness.rounds import Timer
from instrumentation.roofline import Rates

#: Bytes of the device copy that measures the copy rate on CUDA (1 GiB), and elements of the GEMM side.
CUDA_COPY_BYTES = 1 << 30
CUDA_GEMM_SIZE = 8192
#: Small stand-ins on a CPU (the rates then only keep the roofline columns defined).
CPU_COPY_FLOATS = 1 << 23
CPU_GEMM_SIZE = 512


def is_cuda(device) -> bool:
    return str(device).startswith("cuda")


def event_ms(fn, iters: int, warmup: int = 3) -> list[float]:
    """Milliseconds of ``iters`` calls of ``fn`` on the current CUDA stream, each between two CUDA events (after
    ``warmup`` untimed calls)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def capture(fn) -> "torch.cuda.CUDAGraph":
    """``fn`` captured in a CUDA graph after two warm-up runs (the executors' own capture)."""
    from rollout.executors.graphs import capture_graph

    return capture_graph(fn, [], torch.cuda.graph_pool_handle())


def graph_ms(fn, iters: int) -> float:
    """Median ms of one replay of ``fn`` captured in a CUDA graph (no launch gaps), timed with CUDA events."""
    graph = capture(fn)
    return statistics.median(event_ms(graph.replay, iters, warmup=0))


def measure_rates(device: str, dtype: torch.dtype) -> Rates:
    """The copy rate (bytes read + written per second) and the GEMM rate in ``dtype``: on CUDA a 1 GiB device copy
    and an 8192^3 matmul (medians of 10 after 3 warm-ups, CUDA events); on a CPU small stand-ins (wall clock)."""
    if is_cuda(device):
        x = torch.empty(CUDA_COPY_BYTES, dtype=torch.uint8, device=device)
        y = torch.empty_like(x)
        copy_s = statistics.median(event_ms(lambda: y.copy_(x), 10)) / 1e3
        del x, y
        a = torch.randn(CUDA_GEMM_SIZE, CUDA_GEMM_SIZE, device=device, dtype=dtype)
        b = torch.randn_like(a)
        gemm_s = statistics.median(event_ms(lambda: a @ b, 10)) / 1e3
        del a, b
        torch.cuda.empty_cache()  # later memory decisions read the free memory
        return Rates(2 * CUDA_COPY_BYTES / copy_s, 2 * CUDA_GEMM_SIZE ** 3 / gemm_s)
    timer = Timer(device)
    x = torch.empty(CPU_COPY_FLOATS, dtype=torch.float32)
    y = torch.empty_like(x)
    y.copy_(x)
    copy_s = statistics.median(timer(lambda: y.copy_(x))[0] for _ in range(5)) / 1e3
    a = torch.randn(CPU_GEMM_SIZE, CPU_GEMM_SIZE, dtype=dtype)
    a @ a
    gemm_s = statistics.median(timer(lambda: a @ a)[0] for _ in range(10)) / 1e3
    return Rates(2 * x.numel() * 4 / copy_s, 2 * CPU_GEMM_SIZE ** 3 / gemm_s)


def rates_meta(rates: Rates) -> dict:
    """The measured rates as a result file records them (GB/s, TFLOP/s)."""
    return {"copy_gbps": rates.copy_bytes_s / 1e9, "gemm_tflops": rates.gemm_flops_s / 1e12}

"""Device measurements shared by the benchmarks: the rates the rooflines divide by, CUDA-graph replay timing.

The roofline formulas are in :mod:`instrumentation.roofline` (no torch); what they divide by is measured here, on
CUDA with :func:`instrumentation.probe.measure_cuda_rates` (the profiler's per-run probe, at larger sizes).
"""

from __future__ import annotations

import gc
import statistics

import torch

from benchmarks.harness.rounds import Timer
from instrumentation.probe import event_ms, measure_cuda_rates
from instrumentation.roofline import Rates

#: Bytes of the device copy that measures the copy rate on CUDA (1 GiB), and elements of the GEMM side.
CUDA_COPY_BYTES = 1 << 30
CUDA_GEMM_SIZE = 8192
#: Small stand-ins on a CPU (the rates then only keep the roofline columns defined).
CPU_COPY_FLOATS = 1 << 23
CPU_GEMM_SIZE = 512


def is_cuda(device) -> bool:
    return str(device).startswith("cuda")


def release_memory(device) -> None:
    """Free what dropped objects still hold, then hand the allocator's cached blocks back (CUDA). A ``del`` alone
    does not free an OPSD step: its DeepSpeed engine holds reference cycles, which wait for the cyclic collector.
    ``benchmarks.step`` once ran its long-tail cell with the uniform cell's 3B models still on the GPU (peak 130.7
    GiB, micro-batch budgets cut to 2.8k tokens, 2.19x its roofline against 1.71x)."""
    gc.collect()
    if is_cuda(device):
        torch.cuda.empty_cache()


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
        return measure_cuda_rates(device, dtype, CUDA_COPY_BYTES, CUDA_GEMM_SIZE, iters=10)
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


def print_tuned_plans() -> None:
    """What ``kernels.blas_library="cublaslt-tuned"`` chose in this process on the current CUDA device (nothing
    without CUDA or where no product ran with it), one line a shape."""
    if torch.cuda.is_available():
        from rollout.ops.tuned_gemm import tuner

        for line in tuner(torch.cuda.current_device()).summary():
            print(f"cublaslt-tuned, {line}", flush=True)

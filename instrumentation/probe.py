"""The device's copy and bf16 GEMM rates measured on the GPU (CUDA events; torch imported lazily): once per
profiler session (:func:`probe_rates`) and by the benchmarks (``benchmarks.harness.device.measure_rates``).
:mod:`instrumentation.rates` decides which rate a roofline divides by; this module only measures.
"""

from __future__ import annotations

import statistics
import sys
from typing import Mapping, Optional

from instrumentation import state
from instrumentation.rates import ENV_PEAK_TBPS, ENV_PEAK_TFLOPS
from instrumentation.roofline import Rates

#: The profiler session's probe: a 256 MiB device copy and an 8192^3 bf16 GEMM (the benchmarks' size: a smaller one
#: runs below the peak), medians of 5 after 3 warm-ups: tens of milliseconds on an H200.
PROBE_COPY_BYTES, PROBE_GEMM_SIZE, PROBE_ITERS = 1 << 28, 8192, 5


def event_ms(fn, iters: int, warmup: int = 3) -> list[float]:
    """Milliseconds of ``iters`` calls of ``fn`` on the current CUDA stream, each between two CUDA events (after
    ``warmup`` untimed calls)."""
    import torch

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


def measure_cuda_rates(device, dtype, copy_bytes: int = PROBE_COPY_BYTES, gemm_size: int = PROBE_GEMM_SIZE,
                       iters: int = PROBE_ITERS) -> Rates:
    """The copy rate (a ``copy_bytes`` device copy: 2 * ``copy_bytes`` moved) and the GEMM rate in ``dtype`` (a
    ``gemm_size``^3 matmul) on CUDA ``device``: medians of ``iters`` after warm-ups, CUDA events. Shared by the
    benchmarks (``benchmarks.harness.device.measure_rates``) and :func:`probe_rates`."""
    import torch

    x = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    copy_s = statistics.median(event_ms(lambda: y.copy_(x), iters)) / 1e3
    del x, y
    a = torch.randn(gemm_size, gemm_size, device=device, dtype=dtype)
    b = torch.randn_like(a)
    gemm_s = statistics.median(event_ms(lambda: a @ b, iters)) / 1e3
    del a, b
    torch.cuda.empty_cache()  # later memory decisions read the free memory
    return Rates(2 * copy_bytes / copy_s, 2 * gemm_size ** 3 / gemm_s)


def probe_rates(environ: Mapping[str, str]) -> Optional[Rates]:
    """The current GPU's rates in bf16 (:func:`measure_cuda_rates`, small sizes), once per profiler session; None
    without touching CUDA when torch is not loaded or has no GPU, or when the user set both rates; None with one
    warning when the probe fails."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or all(environ.get(v, "").strip()
                                                              for v in (ENV_PEAK_TFLOPS, ENV_PEAK_TBPS)):
        return None
    try:
        return measure_cuda_rates(torch.cuda.current_device(), torch.bfloat16, iters=PROBE_ITERS)
    except Exception as exc:  # noqa: BLE001 - no measured rates: the data sheet's
        state.warn_once("rates-probe", f"could not measure the device's copy and GEMM rates: {exc!r}")
        return None

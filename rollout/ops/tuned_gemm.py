"""The decode step's projections on the cuBLASLt algorithm timed fastest for each shape
(``RolloutConfig.kernels.blas_library="cublaslt-tuned"``).

PyTorch runs the first algorithm cuBLASLt's heuristic offers. At the decode step's small-M shapes that choice can
be slow: at 256 rows on an H200, down ran at 56% of its compute floor and q|k|v and o at 41-44% (``docs/BENCHMARKS.md``
section 1). :class:`TunedGemm` times, the first time it meets a product's shape (rows, K, N, the in-place residual,
dtype, pointer alignments), the heuristic's candidates and the split-K variants of the fastest few, each captured in
a CUDA graph that runs it over enough stand-ins for the weight to overflow the L2 cache (the step's weights are never
cache-resident: each layer's are distinct, and one launch alone times noisily), and runs that shape on the fastest
whose product stays within ``tolerance`` of PyTorch's (relative to its largest magnitude) from then on. Its choices
are kept per device for the process (:func:`tuner`). Measured on an H100 (``docs/results/h200-2026-12-06b``): down at
256 rows 19% faster (split-K 3, reduced in fp32), the routes' decode step 2.3-2.4% faster at 64-256 rows.

Where it cannot run it leaves the product to PyTorch: off CUDA, other dtypes than bf16/fp16, strided operands, an empty
batch, and a shape first met while a CUDA graph is being captured (timing needs a synchronisation; the routes' captures
warm up eagerly first, so their shapes are tuned by then). A cuBLASLt failure, or no memory left for the stand-ins (at
most ~0.4 GB while choosing), warns once and leaves PyTorch every later product on that device. Which candidate wins
can differ between processes where two time alike; their products differ by rounding only.
"""

from __future__ import annotations

import functools
import statistics
import time
import warnings
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from rollout.ops import cublaslt

#: Heuristic candidates asked for per shape, how many of the fastest get split-K variants, the split-K counts tried.
REQUESTED = 16
FINALISTS = 3
SPLITS = (2, 3, 4, 6, 8)
#: Timed replays per candidate (median), and the largest relative difference from PyTorch's product accepted.
REPS = 5
#: How many stand-ins for a weight one replay runs through (bounds of the count that overflows the L2 cache 3x).
MIN_STAND_INS, MAX_STAND_INS = 4, 32
TOLERANCE = 2e-2


@dataclass(frozen=True)
class Candidate:
    """One timed algorithm: where it came from (``"heuristic 2"``, ``"heuristic 2, split-K 4"``), its median ms a
    launch with the weight cold, and ``max |its product - PyTorch's| / max |PyTorch's|``."""

    source: str
    ms: float
    rel_diff: float


def choose(candidates: Sequence[Candidate], tolerance: float = TOLERANCE) -> Optional[int]:
    """The index of the fastest candidate within ``tolerance`` (the earlier one on a tie), None if there is none."""
    good = [i for i, c in enumerate(candidates) if c.rel_diff <= tolerance and c.ms == c.ms]
    return min(good, key=lambda i: (candidates[i].ms, i)) if good else None


@dataclass(frozen=True)
class Plan:
    """What one shape runs on: the chosen candidate, the heuristic's first choice for comparison, the algorithm's
    configuration (``rollout.ops.cublaslt.config``) and every candidate timed."""

    chosen: Candidate
    first: Candidate
    config: dict
    candidates: tuple = field(repr=False)
    product: object = field(repr=False, default=None)
    algo: object = field(repr=False, default=None)


class TunedGemm:
    """``mm(x, w) = x @ w.t()`` and ``addmm_(h, x, w): h += x @ w.t()`` on one CUDA device, each shape on its
    fastest cuBLASLt algorithm (module docstring)."""

    def __init__(self, device_index: int, tolerance: float = TOLERANCE):
        self.device_index, self.tolerance = device_index, tolerance
        self.plans: dict = {}
        """(rows, K, N, residual, dtype, alignments) -> :class:`Plan`."""
        self.failure: Optional[str] = None
        self.untuned_in_capture = 0
        """Products left to PyTorch because their shape was first met inside a CUDA graph capture."""
        self.tune_s = 0.0
        """Wall seconds spent choosing (the host waits on the device while it times the candidates)."""
        self._workspace: Optional[torch.Tensor] = None

    def mm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], w.shape[0], device=x.device, dtype=x.dtype)
        return out if self._run(x, w, out, residual=False) else torch.mm(x, w.t())

    def addmm_(self, h: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return h if self._run(x, w, h, residual=True) else h.addmm_(x, w.t())

    def summary(self) -> list[str]:
        """One line per tuned shape: the pick and its time against the heuristic's first choice."""
        return [f"rows {key[0]} K {key[1]} N {key[2]}{' +=' if key[3] else ''}: {plan.chosen.source} "
                f"{plan.chosen.ms * 1e3:.1f} us against the heuristic's first {plan.first.ms * 1e3:.1f} us "
                f"({len(plan.candidates)} candidates)" for key, plan in self.plans.items()]

    def _run(self, x, w, out, residual: bool) -> bool:
        if (self.failure is not None or x.device.type != "cuda" or x.dtype not in cublaslt.DATA_TYPES
                or not (x.dtype == w.dtype == out.dtype) or x.shape[0] == 0 or not _dense(x) or not _dense(w)
                or not _dense(out) or tuple(out.shape) != (x.shape[0], w.shape[0]) or x.shape[1] != w.shape[1]):
            return False
        aligns = tuple(cublaslt.alignment(t.data_ptr()) for t in (w, x, out))
        key = (x.shape[0], x.shape[1], w.shape[0], residual, x.dtype, aligns)
        plan = self.plans.get(key)
        try:
            if plan is None:
                if torch.cuda.is_current_stream_capturing():
                    self.untuned_in_capture += 1
                    return False
                began = time.perf_counter()
                plan = self.plans[key] = self._tune(x, w, residual, aligns)
                self.tune_s += time.perf_counter() - began
            plan.product.launch(plan.algo, w.data_ptr(), x.data_ptr(), out.data_ptr(), self._workspace.data_ptr(),
                                torch.cuda.current_stream(x.device).cuda_stream)
        except (cublaslt.CublasLtError, torch.cuda.OutOfMemoryError) as exc:  # e.g. no room for the stand-ins
            self.failure = str(exc)
            warnings.warn(f"cublaslt-tuned: {exc}; PyTorch's products from now on (device {self.device_index})",
                          RuntimeWarning, stacklevel=4)
            return False
        return True

    def _tune(self, x: torch.Tensor, w: torch.Tensor, residual: bool, aligns) -> Plan:
        if self._workspace is None:
            self._workspace = torch.empty(cublaslt.WORKSPACE, device=x.device, dtype=torch.uint8)
        rows, k, n = x.shape[0], x.shape[1], w.shape[0]
        product = cublaslt.Product(self.device_index, rows, k, n, residual, x.dtype, aligns)
        ref = torch.mm(x, w.t())
        # The check starts D at the product itself: with the residual add the result must be twice it (an algorithm
        # mishandling beta shows), without it just the product (beta 0 must ignore what D held).
        start_d = ref.clone()
        expected = ref.float() * (2.0 if residual else 1.0)
        scale = float(expected.abs().max()) or 1.0
        scratch = torch.empty(rows, n, device=x.device, dtype=x.dtype)
        # Stand-ins for the weight, enough that together they overflow the L2 cache three times: timed one after
        # another in a CUDA graph, each finds its weight cold, as the step's layers do (each its own weights).
        l2 = torch.cuda.get_device_properties(x.device).L2_cache_size
        count = min(MAX_STAND_INS, max(MIN_STAND_INS, -(-3 * l2 // (w.numel() * w.element_size()))))
        stand_ins = [torch.zeros_like(w, memory_format=torch.contiguous_format) for _ in range(count)]
        current, side = torch.cuda.current_stream(x.device), torch.cuda.Stream(x.device)
        ws = self._workspace.data_ptr()

        def measure(source, algo):
            scratch.copy_(start_d)
            product.launch(algo, w.data_ptr(), x.data_ptr(), scratch.data_ptr(), ws, current.cuda_stream)
            rel = float((scratch.float() - expected).abs().max()) / scale
            graph = torch.cuda.CUDAGraph()
            side.wait_stream(current)
            with torch.cuda.stream(side):  # capture_begin/end: torch.cuda.graph would collect garbage every time
                graph.capture_begin()  # a private pool of its own (a shared one dies with its first graph)
                try:
                    for buf in stand_ins:
                        product.launch(algo, buf.data_ptr(), x.data_ptr(), scratch.data_ptr(), ws, side.cuda_stream)
                finally:
                    graph.capture_end()
            current.wait_stream(side)
            graph.replay()
            events = []
            for _ in range(REPS):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                events.append((start, end))
            torch.cuda.synchronize(x.device)
            return Candidate(source, statistics.median(s.elapsed_time(e) for s, e in events) / count, rel)

        reductions = (cublaslt.INPLACE, cublaslt.COMPUTE_TYPE)
        swept = cublaslt.sweep(product, measure, REQUESTED, FINALISTS, SPLITS, reductions)
        if not swept:
            raise cublaslt.CublasLtError(f"no algorithm for rows {rows}, K {k}, N {n}")
        timed = [result for _, _, result in swept]
        best = choose(timed, self.tolerance)
        if best is None:
            raise cublaslt.CublasLtError(f"no algorithm within {self.tolerance} of PyTorch's product for rows {rows}, "
                                         f"K {k}, N {n}")
        algo = swept[best][1]
        return Plan(timed[best], timed[0], cublaslt.config(algo), tuple(timed), product, algo)


def _dense(t: torch.Tensor) -> bool:
    """A row-major matrix with rows back to back (what the descriptors describe)."""
    return t.dim() == 2 and t.stride(1) == 1 and t.stride(0) == t.shape[1]


@functools.lru_cache(maxsize=None)
def tuner(device_index: int) -> TunedGemm:
    """The process's :class:`TunedGemm` for one CUDA device (its choices kept for every later call)."""
    return TunedGemm(device_index)

"""The decode step's projections on the cuBLASLt algorithm timed fastest for each shape
(``RolloutConfig.kernels.blas_library="cublaslt-tuned"``).

PyTorch runs the first algorithm cuBLASLt's heuristic offers. At the decode step's small-M shapes that choice can
be slow: at 256 rows on an H200, down ran at 56% of its compute floor and q|k|v and o at 41-44% (``docs/BENCHMARKS.md``
section 1). :class:`TunedGemm` times, the first time it meets a product's shape (rows, K, N, the in-place residual,
dtype, pointer alignments), the heuristic's candidates and the split-K variants of the fastest few, each captured in
a CUDA graph that runs it over enough stand-ins for the weight to overflow the L2 cache (the step's weights are never
cache-resident: each layer's are distinct, and one launch alone times noisily), and runs that shape on the fastest
whose product stays within ``tolerance`` of PyTorch's (relative to its largest magnitude) from then on. PyTorch's own
product is timed the same way and keeps the shape unless an algorithm beats it by ``MIN_GAIN`` (1%): a near tie is
noise, and leaving it to PyTorch keeps the process's sums in PyTorch's order. Its choices are kept per device for
the process (:func:`tuner`). Measured on an H100 (``docs/results/h200-2026-12-06b`` to ``-06d``): down at 256 rows
15-19% faster (split-K 3), the routes' decode step 0.1-2.6% faster at 64-256 rows. Timing a product alone misses
what it costs the kernels around it: after down's split-K pick the decode attention ran ~2 us a layer slower (06d).

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
#: The source name of PyTorch's own product among the candidates, and how much faster (a fraction of its time) an
#: algorithm must be to replace it.
PYTORCH = "pytorch"
MIN_GAIN = 0.01


@dataclass(frozen=True)
class Candidate:
    """One timed algorithm: where it came from (``"heuristic 2"``, ``"heuristic 2, split-K 4"``), its median ms a
    launch with the weight cold, and ``max |its product - PyTorch's| / max |PyTorch's|``."""

    source: str
    ms: float
    rel_diff: float


def choose(candidates: Sequence[Candidate], tolerance: float = TOLERANCE, min_gain: float = 0.0) -> Optional[int]:
    """The index of the fastest candidate within ``tolerance`` (the earlier one on a tie), None if there is none; where
    one is PyTorch's own product (:data:`PYTORCH`), that one unless the fastest takes at most ``1 - min_gain`` of its
    time."""
    good = [i for i, c in enumerate(candidates) if c.rel_diff <= tolerance and c.ms == c.ms]
    if not good:
        return None
    best = min(good, key=lambda i: (candidates[i].ms, i))
    base = next((i for i in good if candidates[i].source == PYTORCH), None)
    return base if base is not None and candidates[best].ms > candidates[base].ms * (1.0 - min_gain) else best


@dataclass(frozen=True)
class Plan:
    """What one shape runs on: the chosen candidate, the heuristic's first choice for comparison, the algorithm's
    configuration (``rollout.ops.cublaslt.config``; empty for PyTorch's product) and every candidate timed, PyTorch's
    product among them (``algo`` None: PyTorch runs the shape)."""

    chosen: Candidate
    first: Candidate
    config: dict
    candidates: tuple = field(repr=False)
    product: object = field(repr=False, default=None)
    algo: object = field(repr=False, default=None)

    @property
    def pytorch(self) -> Optional[Candidate]:
        """PyTorch's own product as timed (None: not among the candidates)."""
        return next((c for c in self.candidates if c.source == PYTORCH), None)


class TunedGemm:
    """``mm(x, w) = x @ w.t()`` and ``addmm_(h, x, w): h += x @ w.t()`` on one CUDA device, each shape on its
    fastest cuBLASLt algorithm (module docstring)."""

    def __init__(self, device_index: int, tolerance: float = TOLERANCE, min_gain: float = MIN_GAIN):
        self.device_index, self.tolerance, self.min_gain = device_index, tolerance, min_gain
        self.plans: dict = {}
        """(rows, K, N, residual, dtype, alignments) -> :class:`Plan`."""
        self.failure: Optional[str] = None
        self.untuned_in_capture = 0
        """Products left to PyTorch because their shape was first met inside a CUDA graph capture."""
        self.tune_s = 0.0
        """Wall seconds spent choosing (the host waits on the device while it times the candidates)."""
        self._workspace: Optional[torch.Tensor] = None

    def mm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # the output is a fresh allocation: the caching allocator's blocks start 512-byte aligned
        plan = self._plan(x, w, None, residual=False)
        if plan is not None:
            out = torch.empty(x.shape[0], w.shape[0], device=x.device, dtype=x.dtype)
            if self._launch(plan, x, w, out):
                return out
        return torch.mm(x, w.t())

    def addmm_(self, h: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        plan = self._plan(x, w, h, residual=True)
        return h if plan is not None and self._launch(plan, x, w, h) else h.addmm_(x, w.t())

    def summary(self) -> list[str]:
        """One line per tuned shape: the pick and its time against PyTorch's product and the heuristic's first."""
        lines = []
        for key, plan in self.plans.items():
            torch_part = f"PyTorch's {plan.pytorch.ms * 1e3:.1f} us, " if plan.pytorch is not None else ""
            lines.append(f"rows {key[0]} K {key[1]} N {key[2]}{' +=' if key[3] else ''}: {plan.chosen.source} "
                         f"{plan.chosen.ms * 1e3:.1f} us against {torch_part}the heuristic's first "
                         f"{plan.first.ms * 1e3:.1f} us ({len(plan.candidates)} candidates)")
        return lines

    def _plan(self, x, w, out, residual: bool) -> Optional[Plan]:
        """The plan of this product's shape, chosen now if new; None where PyTorch runs it (``out`` None: a fresh
        output of ``mm``)."""
        rows, cols = x.shape[0], w.shape[0]
        if (self.failure is not None or x.device.type != "cuda" or x.dtype not in cublaslt.DATA_TYPES
                or x.dtype != w.dtype or rows == 0 or not _dense(x) or not _dense(w) or x.shape[1] != w.shape[1]
                or (out is not None and (out.dtype != x.dtype or not _dense(out) or tuple(out.shape) != (rows, cols)))):
            return None
        out_align = cublaslt.alignment(out.data_ptr()) if out is not None else cublaslt.alignment(0)
        aligns = (cublaslt.alignment(w.data_ptr()), cublaslt.alignment(x.data_ptr()), out_align)
        key = (rows, x.shape[1], cols, residual, x.dtype, aligns)
        plan = self.plans.get(key)
        if plan is None:
            if torch.cuda.is_current_stream_capturing():
                self.untuned_in_capture += 1
                return None
            began = time.perf_counter()
            try:
                plan = self.plans[key] = self._tune(x, w, residual, aligns)
            except (cublaslt.CublasLtError, torch.cuda.OutOfMemoryError) as exc:  # e.g. no room for the stand-ins
                return self._fail(exc)
            finally:
                self.tune_s += time.perf_counter() - began
        return plan if plan.algo is not None else None

    def _launch(self, plan: Plan, x, w, out) -> bool:
        try:
            plan.product.launch(plan.algo, w.data_ptr(), x.data_ptr(), out.data_ptr(), self._workspace.data_ptr(),
                                torch.cuda.current_stream(x.device).cuda_stream)
        except cublaslt.CublasLtError as exc:
            return self._fail(exc) is not None
        return True

    def _fail(self, exc: Exception) -> None:
        self.failure = str(exc)
        warnings.warn(f"cublaslt-tuned: {exc}; PyTorch's products from now on (device {self.device_index})",
                      RuntimeWarning, stacklevel=5)

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

        def timed(source, run):
            """``run(weight, stream)`` checked once, then timed over the stand-ins in a CUDA graph."""
            scratch.copy_(start_d)
            side.wait_stream(current)
            with torch.cuda.stream(side):  # also allocates PyTorch's BLAS workspace of this stream before capture
                run(w, side)
            current.wait_stream(side)
            rel = float((scratch.float() - expected).abs().max()) / scale
            graph = torch.cuda.CUDAGraph()
            side.wait_stream(current)
            with torch.cuda.stream(side):  # capture_begin/end: torch.cuda.graph would collect garbage every time
                graph.capture_begin()  # a private pool of its own (a shared one dies with its first graph)
                try:
                    for buf in stand_ins:
                        run(buf, side)
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

        def measure(source, algo):
            return timed(source, lambda weight, stream: product.launch(algo, weight.data_ptr(), x.data_ptr(),
                                                                       scratch.data_ptr(), ws, stream.cuda_stream))

        def pytorch(weight, stream):
            if residual:
                scratch.addmm_(x, weight.t())
            else:
                torch.mm(x, weight.t(), out=scratch)

        baseline = timed(PYTORCH, pytorch)
        reductions = (cublaslt.INPLACE, cublaslt.COMPUTE_TYPE)
        swept = cublaslt.sweep(product, measure, REQUESTED, FINALISTS, SPLITS, reductions)
        if not swept:
            raise cublaslt.CublasLtError(f"no algorithm for rows {rows}, K {k}, N {n}")
        timed_all = [baseline] + [result for _, _, result in swept]
        best = choose(timed_all, self.tolerance, self.min_gain)
        if best is None:
            raise cublaslt.CublasLtError(f"no algorithm within {self.tolerance} of PyTorch's product for rows {rows}, "
                                         f"K {k}, N {n}")
        algo = swept[best - 1][1] if best > 0 else None
        return Plan(timed_all[best], timed_all[1], cublaslt.config(algo) if algo is not None else {},
                    tuple(timed_all), product, algo)


def _dense(t: torch.Tensor) -> bool:
    """A row-major matrix with rows back to back (what the descriptors describe)."""
    return t.dim() == 2 and t.stride(1) == 1 and t.stride(0) == t.shape[1]


@functools.lru_cache(maxsize=None)
def tuner(device_index: int) -> TunedGemm:
    """The process's :class:`TunedGemm` for one CUDA device (its choices kept for every later call)."""
    return TunedGemm(device_index)

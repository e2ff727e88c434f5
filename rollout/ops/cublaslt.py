"""cuBLASLt, called directly: the algorithms it offers for one product, and that product run on a chosen one.

PyTorch asks cuBLASLt's heuristic for one algorithm per GEMM and runs it. This binds the few entry points needed to
see the others (``ctypes`` on the ``libcublasLt`` PyTorch has loaded, so no build step): a :class:`Product` describes
the decode step's ``D [M, N] = x [M, K] @ W [N, K].t()`` (``+ D`` with ``residual``: the in-place residual add of o
and down) as cuBLASLt's column-major ``D^T = op_T(W) @ x^T``; its :meth:`Product.heuristics` lists the algorithms the
heuristic offers, :meth:`Product.variant` sets an algorithm's split-K count and reduction scheme (checked by
``cublasLtMatmulAlgoCheck``), :meth:`Product.launch` runs it on a stream (capturable in a CUDA graph: the workspace is
the caller's). :mod:`rollout.ops.tuned_gemm` times them; ``python -m benchmarks.gemm_algos`` tabulates them.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Callable, Sequence

import torch

# cuBLASLt's enums (cublasLt.h, CUDA 12 and 13).
_COMPUTE_32F, _R_32F = 68, 0
DATA_TYPES = {torch.bfloat16: 14, torch.float16: 2}
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_OP_N, _OP_T = 0, 1
_PREF_MAX_WORKSPACE = 1
_PREF_MIN_ALIGNMENT = (5, 6, 7, 8)  # A, B, C, D
#: Algorithm config attributes: name -> (attribute, bytes).
CONFIG = {"algo": (0, 4), "tile": (1, 4), "splitk": (2, 4), "reduction": (3, 4), "swizzle": (4, 4),
          "custom": (5, 4), "stages": (6, 4), "inner": (7, 2), "cluster": (8, 2)}
#: Reduction schemes of a split-K algorithm: none, in place, in the compute type (float32), in the output type.
NO_REDUCTION, INPLACE, COMPUTE_TYPE, OUTPUT_TYPE = 0, 1, 2, 4
#: Workspace bytes an algorithm may use (PyTorch's own cuBLASLt workspace on Hopper).
WORKSPACE = 32 << 20


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class Heuristic(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


class CublasLtError(RuntimeError):
    """A cuBLASLt call returned an error status (or the library is not loaded)."""


def ok(status: int, what: str) -> None:
    if status != 0:
        raise CublasLtError(f"{what}: cuBLAS status {status}")


@functools.lru_cache(maxsize=None)
def library() -> ctypes.CDLL:
    """The ``libcublasLt`` this process's PyTorch uses (found in ``/proc/self/maps`` after one cuBLASLt product on the
    current CUDA device), with the signatures of the entry points bound here."""
    if not torch.cuda.is_available():
        raise CublasLtError("cuBLASLt needs a CUDA device")
    before = torch.backends.cuda.preferred_blas_library()
    try:
        torch.backends.cuda.preferred_blas_library("cublaslt")
        a = torch.ones(16, 16, device="cuda", dtype=torch.bfloat16)
        torch.mm(a, a)
        torch.cuda.synchronize()
    finally:
        torch.backends.cuda.preferred_blas_library(before)
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "libcublasLt.so" in line})
    except OSError as exc:
        raise CublasLtError(f"cannot read /proc/self/maps: {exc}") from exc
    if not paths:
        raise CublasLtError("libcublasLt is not loaded in this process")
    lib = ctypes.CDLL(paths[0])
    vp, i32, sz, ptr = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.POINTER
    signatures = {
        "cublasLtCreate": [ptr(vp)],
        "cublasLtMatmulDescCreate": [ptr(vp), i32, i32],
        "cublasLtMatmulDescSetAttribute": [vp, i32, vp, sz],
        "cublasLtMatrixLayoutCreate": [ptr(vp), i32, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64],
        "cublasLtMatmulPreferenceCreate": [ptr(vp)],
        "cublasLtMatmulPreferenceSetAttribute": [vp, i32, vp, sz],
        "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, i32, ptr(Heuristic), ptr(i32)],
        "cublasLtMatmulAlgoCheck": [vp, vp, vp, vp, vp, vp, ptr(Algo), ptr(Heuristic)],
        "cublasLtMatmulAlgoConfigGetAttribute": [ptr(Algo), i32, vp, sz, ptr(sz)],
        "cublasLtMatmulAlgoConfigSetAttribute": [ptr(Algo), i32, vp, sz],
        "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, ptr(Algo), vp, sz, vp],
    }
    for name, args in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    return lib


@functools.lru_cache(maxsize=None)
def handle(device_index: int) -> ctypes.c_void_p:
    """One cuBLASLt handle per device (created with that device current)."""
    lib = library()
    out = ctypes.c_void_p()
    with torch.cuda.device(device_index):
        ok(lib.cublasLtCreate(ctypes.byref(out)), "cublasLtCreate")
    return out


def alignment(address: int) -> int:
    """The largest power of two up to 256 that divides ``address`` (what cuBLASLt may assume of a pointer)."""
    return min(256, address & -address) if address else 256


def config(algo: Algo) -> dict:
    """An algorithm's configuration (algorithm id, tile, split-K, reduction scheme, stages, cluster, ...)."""
    lib, out = library(), {}
    for name, (attr, size) in CONFIG.items():
        buf, written = (ctypes.c_uint32 if size == 4 else ctypes.c_uint16)(0), ctypes.c_size_t(0)
        status = lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(buf), size,
                                                          ctypes.byref(written))
        out[name] = int(buf.value) if status == 0 else None
    return out


class Product:
    """``D [rows, n] = x [rows, k] @ W [n, k].t()`` (``+ D`` with ``residual``) in ``dtype`` on one device, all three
    contiguous, with pointers aligned to ``aligns`` bytes (W, x, D)."""

    def __init__(self, device_index: int, rows: int, k: int, n: int, residual: bool, dtype: torch.dtype,
                 aligns: tuple[int, int, int] = (256, 256, 256)):
        self.lib, self.handle, self.residual = library(), handle(device_index), residual
        lib, vp, data = self.lib, ctypes.c_void_p, DATA_TYPES[dtype]
        self.desc, self.a, self.b, self.d, self.pref = vp(), vp(), vp(), vp(), vp()
        ok(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _COMPUTE_32F, _R_32F), "matmul descriptor")
        for attr, op in ((_DESC_TRANSA, _OP_T), (_DESC_TRANSB, _OP_N)):
            value = ctypes.c_int32(op)
            ok(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(value), 4), "transpose")
        ok(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self.a), data, k, n, k), "layout of W")
        ok(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self.b), data, k, rows, k), "layout of x")
        ok(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self.d), data, n, rows, n), "layout of D")
        ok(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(self.pref)), "preference")
        limit = ctypes.c_uint64(WORKSPACE)
        ok(lib.cublasLtMatmulPreferenceSetAttribute(self.pref, _PREF_MAX_WORKSPACE, ctypes.byref(limit), 8), "pref")
        a, b, d = aligns
        for attr, value in zip(_PREF_MIN_ALIGNMENT, (a, b, d, d)):
            v = ctypes.c_uint32(value)
            ok(lib.cublasLtMatmulPreferenceSetAttribute(self.pref, attr, ctypes.byref(v), 4), "alignment")
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(1.0 if residual else 0.0)

    def heuristics(self, requested: int) -> list[Heuristic]:
        """Up to ``requested`` algorithms the heuristic offers, best first by its estimate."""
        results, count = (Heuristic * requested)(), ctypes.c_int(0)
        ok(self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, self.a, self.b, self.d, self.d, self.pref,
                                                   requested, results, ctypes.byref(count)), "heuristic")
        return [results[i] for i in range(count.value) if results[i].state == 0]

    def variant(self, algo: Algo, splitk: int, reduction: int):
        """A copy of ``algo`` with ``splitk`` parts of the inner dimension reduced by ``reduction``, or None where
        cuBLASLt refuses it for this product (or it needs more than :data:`WORKSPACE`)."""
        copy = Algo()
        ctypes.memmove(ctypes.byref(copy), ctypes.byref(algo), ctypes.sizeof(Algo))
        for attr, value in ((CONFIG["splitk"][0], splitk), (CONFIG["reduction"][0], reduction)):
            buf = ctypes.c_uint32(value)
            if self.lib.cublasLtMatmulAlgoConfigSetAttribute(ctypes.byref(copy), attr, ctypes.byref(buf), 4):
                return None
        check = Heuristic()
        status = self.lib.cublasLtMatmulAlgoCheck(self.handle, self.desc, self.a, self.b, self.d, self.d,
                                                  ctypes.byref(copy), ctypes.byref(check))
        return copy if status == 0 and check.state == 0 and check.workspace <= WORKSPACE else None

    def launch(self, algo: Algo, w: int, x: int, d: int, workspace: int, stream: int) -> None:
        """Run on ``stream`` with the tensors' addresses (``d`` is read too with ``residual``)."""
        ok(self.lib.cublasLtMatmul(self.handle, self.desc, ctypes.byref(self.alpha), w, self.a, x, self.b,
                                   ctypes.byref(self.beta), d, self.d, d, self.d, ctypes.byref(algo), workspace,
                                   WORKSPACE, stream), "cublasLtMatmul")


def sweep(product: Product, measure: Callable, requested: int, finalists: int, splits: Sequence[int],
          reductions: Sequence[int], ms: Callable = lambda result: result.ms) -> list[tuple]:
    """``(source, algo, measure(source, algo))`` for the heuristic's algorithms (up to ``requested``, as
    ``"heuristic i"``), then, for the ``finalists`` fastest of them by ``ms(result)``, each split-K count of ``splits``
    with each of ``reductions`` (a count of 1 with none) that cuBLASLt accepts (``"heuristic i, split-K s reduction
    r"``). The candidates :mod:`rollout.ops.tuned_gemm` and ``benchmarks.gemm_algos`` time."""
    out = [(source, algo, measure(source, algo))
           for source, algo in ((f"heuristic {i}", h.algo) for i, h in enumerate(product.heuristics(requested)))]
    for source, algo, _ in sorted(out, key=lambda t: ms(t[2]))[:finalists]:
        for splitk in splits:
            for reduction in (reductions if splitk > 1 else (NO_REDUCTION,)):
                variant = product.variant(algo, splitk, reduction)
                if variant is not None:
                    name = f"{source}, split-K {splitk} reduction {reduction}"
                    out.append((name, variant, measure(name, variant)))
    return out

"""The decode step's projections on every cuBLASLt algorithm the library offers, against the one PyTorch runs.

PyTorch asks cuBLASLt's heuristic for one algorithm per GEMM and runs it. The decode step's small-M products sit
at 41-56% of their compute floor at 256 rows (q|k|v, o, down; BENCHMARKS.md section 1), so this asks whether
another algorithm of the same library does better: it calls cuBLASLt directly (``ctypes`` on the ``libcublasLt``
PyTorch has loaded), takes up to ``--requested`` heuristic candidates per shape and, for the fastest few, every
split-K count in ``--splits`` with each reduction scheme ``cublasLtMatmulAlgoCheck`` accepts. Each candidate runs
36 layers of distinct weights (no weight stays in the L2 cache) captured in a CUDA graph, median of ``--iters``
replays, exactly the product the step runs (``torch.mm(x, W.t())``; for o and down ``h.addmm_(x, W.t())``, beta 1),
and is checked against PyTorch's result.

  python -m benchmarks.gemm_algos --rows 64 128 256 --json out.json
"""

from __future__ import annotations

import argparse
import ctypes
import sys

import torch

from benchmarks.gemm_layouts import LAYERS, PROJECTIONS
from benchmarks.harness.device import graph_ms
from benchmarks.harness.meta import header, run_meta
from benchmarks.harness.results import write
from benchmarks.harness.table import markdown_table

# cuBLASLt's enums (cublasLt.h, CUDA 12 and 13).
_COMPUTE_32F, _R_32F, _R_16BF = 68, 0, 14
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_OP_N, _OP_T = 0, 1
_PREF_MAX_WORKSPACE = 1
#: Algorithm config attributes: name -> (attribute, bytes).
_CONFIG = {"algo": (0, 4), "tile": (1, 4), "splitk": (2, 4), "reduction": (3, 4), "swizzle": (4, 4),
           "custom": (5, 4), "stages": (6, 4), "inner": (7, 2), "cluster": (8, 2)}
#: Reduction schemes: none, in place, in the compute type, in the output type.
_REDUCTIONS = (1, 2, 4)
WORKSPACE = 32 << 20


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):
    _fields_ = [("algo", _Algo), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _library() -> ctypes.CDLL:
    """The ``libcublasLt`` this process's PyTorch loaded (found in ``/proc/self/maps`` after a cuBLASLt product)."""
    torch.backends.cuda.preferred_blas_library("cublaslt")
    a = torch.ones(64, 64, device="cuda", dtype=torch.bfloat16)
    torch.mm(a, a)
    torch.cuda.synchronize()
    with open("/proc/self/maps") as maps:
        paths = sorted({line.split()[-1] for line in maps if "libcublasLt.so" in line})
    if not paths:
        raise RuntimeError("libcublasLt is not loaded in this process")
    lib = ctypes.CDLL(paths[0])
    vp, i32, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    sigs = {"cublasLtCreate": [ctypes.POINTER(vp)],
            "cublasLtMatmulDescCreate": [ctypes.POINTER(vp), i32, i32],
            "cublasLtMatmulDescSetAttribute": [vp, i32, vp, sz],
            "cublasLtMatrixLayoutCreate": [ctypes.POINTER(vp), i32, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64],
            "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(vp)],
            "cublasLtMatmulPreferenceSetAttribute": [vp, i32, vp, sz],
            "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, i32, ctypes.POINTER(_Heuristic),
                                               ctypes.POINTER(i32)],
            "cublasLtMatmulAlgoCheck": [vp, vp, vp, vp, vp, vp, ctypes.POINTER(_Algo), ctypes.POINTER(_Heuristic)],
            "cublasLtMatmulAlgoConfigGetAttribute": [ctypes.POINTER(_Algo), i32, vp, sz, ctypes.POINTER(sz)],
            "cublasLtMatmulAlgoConfigSetAttribute": [ctypes.POINTER(_Algo), i32, vp, sz],
            "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, ctypes.POINTER(_Algo), vp, sz, vp]}
    for name, args in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    return lib


def _ok(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what}: cuBLAS status {status}")


def config(lib, algo: _Algo) -> dict:
    """An algorithm's configuration (tile, split-K, reduction scheme, stages, cluster, ...) as numbers."""
    out = {}
    for name, (attr, size) in _CONFIG.items():
        buf, written = (ctypes.c_uint32 if size == 4 else ctypes.c_uint16)(0), ctypes.c_size_t(0)
        status = lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(buf), size,
                                                          ctypes.byref(written))
        out[name] = int(buf.value) if status == 0 else None
    return out


class Product:
    """One projection's decode-step product ``D[M, N] = x[M, K] @ W[N, K].t() (+ D)`` as cuBLASLt sees it: column-major
    ``D^T = op_T(W) @ x^T``, with its descriptors, over ``LAYERS`` weights."""

    def __init__(self, lib, handle, rows: int, k: int, n: int, residual: bool):
        self.lib, self.handle, self.residual = lib, handle, residual
        vp = ctypes.c_void_p
        self.desc, self.a, self.b, self.d, self.pref = vp(), vp(), vp(), vp(), vp()
        _ok(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _COMPUTE_32F, _R_32F), "desc")
        for attr, op in ((_DESC_TRANSA, _OP_T), (_DESC_TRANSB, _OP_N)):
            value = ctypes.c_int32(op)
            _ok(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(value), 4), "trans")
        _ok(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self.a), _R_16BF, k, n, k), "layout A")
        _ok(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self.b), _R_16BF, k, rows, k), "layout B")
        _ok(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self.d), _R_16BF, n, rows, n), "layout D")
        _ok(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(self.pref)), "preference")
        limit = ctypes.c_uint64(WORKSPACE)
        _ok(lib.cublasLtMatmulPreferenceSetAttribute(self.pref, _PREF_MAX_WORKSPACE, ctypes.byref(limit), 8), "pref")
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(1.0 if residual else 0.0)

    def heuristics(self, requested: int) -> list[_Heuristic]:
        results, count = (_Heuristic * requested)(), ctypes.c_int(0)
        _ok(self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, self.a, self.b, self.d, self.d,
                                                    self.pref, requested, results, ctypes.byref(count)), "heuristic")
        return [results[i] for i in range(count.value) if results[i].state == 0]

    def variant(self, algo: _Algo, splitk: int, reduction: int):
        """A copy of ``algo`` with ``splitk`` and ``reduction`` set, or None where cuBLASLt refuses it."""
        copy = _Algo()
        ctypes.memmove(ctypes.byref(copy), ctypes.byref(algo), ctypes.sizeof(_Algo))
        for attr, value in ((_CONFIG["splitk"][0], splitk), (_CONFIG["reduction"][0], reduction)):
            buf = ctypes.c_uint32(value)
            if self.lib.cublasLtMatmulAlgoConfigSetAttribute(ctypes.byref(copy), attr, ctypes.byref(buf), 4):
                return None
        check = _Heuristic()
        status = self.lib.cublasLtMatmulAlgoCheck(self.handle, self.desc, self.a, self.b, self.d, self.d,
                                                  ctypes.byref(copy), ctypes.byref(check))
        return copy if status == 0 and check.state == 0 and check.workspace <= WORKSPACE else None

    def run(self, algo: _Algo, weights: list, x: torch.Tensor, out: torch.Tensor, workspace: torch.Tensor):
        """A closure running the product over every layer's weight on the current stream (graph-capturable)."""
        lib, handle, desc, a, b, d = self.lib, self.handle, self.desc, self.a, self.b, self.d
        alpha, beta, ref = ctypes.byref(self.alpha), ctypes.byref(self.beta), ctypes.byref(algo)
        ptrs = [w.data_ptr() for w in weights]

        def go():
            stream = torch.cuda.current_stream().cuda_stream
            for p in ptrs:
                _ok(lib.cublasLtMatmul(handle, desc, alpha, p, a, x.data_ptr(), b, beta, out.data_ptr(), d,
                                       out.data_ptr(), d, ref, workspace.data_ptr(), WORKSPACE, stream), "matmul")
        return go


def _torch_run(weights: list, residual: bool, x: torch.Tensor, out: torch.Tensor):
    def go():
        for w in weights:
            out.addmm_(x, w.t()) if residual else torch.mm(x, w.t(), out=out)
    return go


def search(lib, handle, rows: int, requested: int, splits: list[int], finalists: int, iters: int) -> list[dict]:
    out_rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    workspace = torch.empty(WORKSPACE, device="cuda", dtype=torch.uint8)
    for name, (k, n, residual) in PROJECTIONS.items():
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * k ** -0.5
                   for _ in range(LAYERS)]
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        out = torch.zeros(rows, n, device="cuda", dtype=torch.bfloat16)
        flops = 2 * rows * k * n * LAYERS
        base = torch.zeros(rows, n, device="cuda", dtype=torch.bfloat16)
        base.addmm_(x, weights[0].t()) if residual else torch.mm(x, weights[0].t(), out=base)
        torch_ms = graph_ms(_torch_run(weights, residual, x, out), iters)
        product = Product(lib, handle, rows, k, n, residual)

        def timed(algo, source):
            check = torch.zeros(rows, n, device="cuda", dtype=torch.bfloat16)
            product.run(algo, weights[:1], x, check, workspace)()
            diff = float((check.float() - base.float()).abs().max())
            ms = graph_ms(product.run(algo, weights, x, out, workspace), iters)
            return {"projection": name, "rows": rows, "source": source, "ms": ms, "torch_ms": torch_ms,
                    "tflops": flops / ms / 1e9, "max_diff": diff, **config(lib, algo)}

        algos = {f"heuristic {i}": h.algo for i, h in enumerate(product.heuristics(requested))}
        candidates = [timed(algo, source) for source, algo in algos.items()]
        for cand in sorted(candidates, key=lambda c: c["ms"])[:finalists]:
            for splitk in splits:
                for reduction in (_REDUCTIONS if splitk > 1 else (0,)):
                    algo = product.variant(algos[cand["source"]], splitk, reduction)
                    if algo is not None:
                        candidates.append(timed(algo, f"{cand['source']}, split-K {splitk} reduction {reduction}"))
        out_rows.extend(candidates)
        print(f"{name} rows {rows}: torch {torch_ms:.3f} ms, {len(candidates)} candidates, best "
              f"{min(c['ms'] for c in candidates):.3f} ms", flush=True)
    return out_rows


def table(rows: list[dict], tolerance: float) -> str:
    """Per projection and row count: PyTorch's ms, the heuristic's first choice, the best candidate within
    ``tolerance`` of PyTorch's result and its configuration."""
    lines = []
    keys = sorted({(r["projection"], r["rows"]) for r in rows}, key=lambda kr: (kr[1], list(PROJECTIONS).index(kr[0])))
    for name, count in keys:
        mine = [r for r in rows if (r["projection"], r["rows"]) == (name, count)]
        first = next((r for r in mine if r["source"] == "heuristic 0"), None)
        good = [r for r in mine if r["max_diff"] <= tolerance]
        best = min(good, key=lambda r: r["ms"]) if good else None
        cfg = (f"algo {best['algo']} tile {best['tile']} stages {best['stages']} split-K {best['splitk']} "
               f"red {best['reduction']} swz {best['swizzle']} cluster {best['cluster']} custom {best['custom']}"
               if best else "-")
        lines.append((name, count, mine[0]["torch_ms"], first["ms"] if first else None,
                      best["ms"] if best else None, (best["ms"] / mine[0]["torch_ms"]) if best else None,
                      best["source"] if best else "-", cfg, len(mine)))
    return markdown_table(["projection", "rows", "torch ms", "heuristic 0 ms", "best ms", "best / torch", "best",
                           "its config", "candidates"], lines)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--requested", type=int, default=32, help="heuristic candidates asked for per shape")
    parser.add_argument("--splits", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 16])
    parser.add_argument("--finalists", type=int, default=4, help="fastest heuristic candidates swept over split-K")
    parser.add_argument("--tolerance", type=float, default=0.05, help="max |diff| from PyTorch's result accepted")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    meta = run_meta("gemm_algos", sys.argv[1:] if argv is None else argv, "cuda")
    lib = _library()
    handle = ctypes.c_void_p()
    _ok(lib.cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
    rows = [r for count in args.rows
            for r in search(lib, handle, count, args.requested, args.splits, args.finalists, args.iters)]
    print(header(meta))
    print(table(rows, args.tolerance))
    if args.json:
        write(args.json, meta, rows)
    return rows


if __name__ == "__main__":
    main()

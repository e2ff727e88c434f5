"""The decode step's projections on every cuBLASLt algorithm the library offers, against the one PyTorch runs.

PyTorch asks cuBLASLt's heuristic for one algorithm per GEMM and runs it. The decode step's small-M products sit
at 41-56% of their compute floor at 256 rows (q|k|v, o, down; BENCHMARKS.md section 1), so this asks whether
another algorithm of the same library does better: it calls cuBLASLt directly (``ctypes`` on the ``libcublasLt``
PyTorch has loaded), takes up to ``--requested`` heuristic candidates per shape and, for the fastest few, every
split-K count in ``--splits`` with each reduction scheme ``cublasLtMatmulAlgoCheck`` accepts. Each candidate runs
36 layers of distinct weights (no weight stays in the L2 cache) captured in a CUDA graph, median of ``--iters``
replays, exactly the product the step runs (``torch.mm(x, W.t())``; for o and down ``h.addmm_(x, W.t())``, beta 1),
and is checked against PyTorch's result. The last column names the candidate ``rollout.ops.tuned_gemm.TunedGemm``
(``kernels.blas_library="cublaslt-tuned"``) picks for the shape by its own timing (stand-ins for the weight).

  python -m benchmarks.gemm_algos --rows 64 128 256 --json out.json
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.gemm_layouts import LAYERS, PROJECTIONS
from benchmarks.harness.device import graph_ms
from benchmarks.harness.meta import header, run_meta
from benchmarks.harness.results import write
from benchmarks.harness.table import markdown_table
from rollout.ops import cublaslt
from rollout.ops.tuned_gemm import PYTORCH, TunedGemm

#: Reduction schemes tried with each split-K count above 1.
REDUCTIONS = (cublaslt.INPLACE, cublaslt.COMPUTE_TYPE, cublaslt.OUTPUT_TYPE)


def _lt_run(product, algo, weights: list, x: torch.Tensor, out: torch.Tensor, workspace: torch.Tensor):
    """A closure running ``product`` on ``algo`` over every layer's weight on the current stream (capturable)."""
    ptrs = [w.data_ptr() for w in weights]

    def go():
        stream = torch.cuda.current_stream().cuda_stream
        for p in ptrs:
            product.launch(algo, p, x.data_ptr(), out.data_ptr(), workspace.data_ptr(), stream)
    return go


def _torch_run(weights: list, residual: bool, x: torch.Tensor, out: torch.Tensor):
    def go():
        for w in weights:
            out.addmm_(x, w.t()) if residual else torch.mm(x, w.t(), out=out)
    return go


def search(rows: int, requested: int, splits: list[int], finalists: int, iters: int) -> list[dict]:
    """Every candidate of each projection at ``rows`` rows, timed over 36 layers in a CUDA graph; and which one
    ``TunedGemm`` (the routes' ``cublaslt-tuned``) picks by its own timing (stand-ins for one weight)."""
    out_rows = []
    device = torch.cuda.current_device()
    gen = torch.Generator(device="cuda").manual_seed(0)
    workspace = torch.empty(cublaslt.WORKSPACE, device="cuda", dtype=torch.uint8)
    for name, (k, n, residual) in PROJECTIONS.items():
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * k ** -0.5
                   for _ in range(LAYERS)]
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        out = torch.zeros(rows, n, device="cuda", dtype=torch.bfloat16)
        flops = 2 * rows * k * n * LAYERS
        base = torch.zeros(rows, n, device="cuda", dtype=torch.bfloat16)
        base.addmm_(x, weights[0].t()) if residual else torch.mm(x, weights[0].t(), out=base)
        torch_ms = graph_ms(_torch_run(weights, residual, x, out), iters)
        product = cublaslt.Product(device, rows, k, n, residual, torch.bfloat16)
        tuner = TunedGemm(device)
        tuner.addmm_(torch.zeros_like(out), x, weights[0]) if residual else tuner.mm(x, weights[0])
        picked = next(iter(tuner.plans.values())).chosen.source if tuner.plans else f"none: {tuner.failure}"

        def timed(source, algo):
            check = base.clone()  # D starts at the product: twice it after a residual add, else the product alone
            _lt_run(product, algo, weights[:1], x, check, workspace)()
            diff = float((check.float() - base.float() * (2.0 if residual else 1.0)).abs().max())
            ms = graph_ms(_lt_run(product, algo, weights, x, out, workspace), iters)
            return {"projection": name, "rows": rows, "source": source, "ms": ms, "torch_ms": torch_ms,
                    "tflops": flops / ms / 1e9, "max_diff": diff, "tuned_pick": picked,
                    "tune_ms": tuner.tune_s * 1e3, **cublaslt.config(algo)}

        swept = cublaslt.sweep(product, timed, requested, finalists, splits, REDUCTIONS, ms=lambda r: r["ms"])
        candidates = [result for _, _, result in swept]
        out_rows.extend(candidates)
        print(f"{name} rows {rows}: torch {torch_ms:.3f} ms, {len(candidates)} candidates, best "
              f"{min(c['ms'] for c in candidates):.3f} ms; TunedGemm picks {picked} in {tuner.tune_s * 1e3:.0f} ms",
              flush=True)
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
                      best["source"] if best else "-", cfg, len(mine), mine[0].get("tuned_pick", "-"),
                      _pick_ms(mine)))
    return markdown_table(["projection", "rows", "torch ms", "heuristic 0 ms", "best ms", "best / torch", "best",
                           "its config", "candidates", "TunedGemm's pick", "its ms"], lines)


def _pick_ms(mine: list[dict]):
    """The graph-timed ms of the candidate ``TunedGemm`` picked (a variant without split-K is its base algorithm;
    PyTorch's own product: its time)."""
    pick = mine[0].get("tuned_pick")
    if pick == PYTORCH:  # PyTorch's own product kept the shape
        return mine[0]["torch_ms"]
    same = [r["ms"] for r in mine if r["source"] in (pick, f"{pick}, split-K 1 reduction 0")]
    return min(same) if same else None


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
    rows = [r for count in args.rows for r in search(count, args.requested, args.splits, args.finalists, args.iters)]
    print(header(meta))
    print(table(rows, args.tolerance))
    if args.json:
        write(args.json, meta, rows)
    return rows


if __name__ == "__main__":
    main()

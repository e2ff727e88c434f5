"""The decode step's projections under the two weight layouts cuBLAS can be handed, per BLAS backend.

Our step multiplies each row's activations by a weight ``W [N, K]`` (``nn.Linear``'s layout) as ``x @ W.t()``: the
``torch.mm`` of q|k|v and gate|up, and for o and down the in-place residual add ``h.addmm_(x, W.t())``. cuBLAS picks
its kernel by the operands' layout too, so a kept copy ``W.t().contiguous()`` (``[K, N]``) is another candidate at the
price of its bytes. This times both layouts for the 3B shape's four projections, 36 layers of distinct weights (so no
weight stays in the L2 cache), captured in a CUDA graph, median of ``--iters`` replays, on cuBLASLt and cuBLAS; and
checks the layouts give the same products.

  python -m benchmarks.gemm_layouts --rows 32 64 128 256 --json out.json
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.harness.device import graph_ms
from benchmarks.harness.meta import header, run_meta
from benchmarks.harness.results import write
from benchmarks.harness.table import markdown_table

#: The 3B shape's projections: name -> (K, N, adds into the residual).
PROJECTIONS = {"q|k|v": (2048, 2560, False), "o": (2048, 2048, True), "gate|up": (2048, 22016, False),
               "down": (11008, 2048, True)}
LAYERS = 36
BACKENDS = ("cublaslt", "cublas")
TODAY, KEPT = "W.t() (today)", "kept W.t().contiguous()"


def _product(weights: list, residual: bool, x: torch.Tensor, h: torch.Tensor, out: torch.Tensor):
    """36 layers' products of ``x`` with ``weights`` (already in the layout to hand cuBLAS: ``[K, N]`` views or
    copies), added into ``h`` in place for o and down."""
    def run():
        for w in weights:
            if residual:
                h.addmm_(x, w)
            else:
                torch.mm(x, w, out=out)
    return run


def time_layouts(rows: int, iters: int) -> list[dict]:
    rows_out = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (k, n, residual) in PROJECTIONS.items():
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * k ** -0.5
                   for _ in range(LAYERS)]
        layouts = {TODAY: [w.t() for w in weights], KEPT: [w.t().contiguous() for w in weights]}
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        flops = 2 * rows * k * n * LAYERS
        for backend in BACKENDS:
            torch.backends.cuda.preferred_blas_library(backend)
            results = {}
            for layout, ws in layouts.items():
                h = torch.zeros(rows, n, device="cuda", dtype=torch.bfloat16)
                out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
                ms = graph_ms(_product(ws, residual, x, h, out), iters)
                check = torch.zeros(rows, n, device="cuda", dtype=torch.bfloat16)
                check.addmm_(x, ws[0]) if residual else torch.mm(x, ws[0], out=check)
                results[layout] = check
                rows_out.append({"projection": name, "rows": rows, "backend": backend, "layout": layout, "ms": ms,
                                 "tflops": flops / ms / 1e9, "weight_gb": 2 * k * n * LAYERS / 1e9})
            first, second = results.values()
            rows_out[-1]["max_diff"] = rows_out[-2]["max_diff"] = float((first.float() - second.float()).abs().max())
        del weights, layouts
    torch.backends.cuda.preferred_blas_library("cublaslt")
    return rows_out


def table(rows: list[dict]) -> str:
    """One line per projection, row count and backend: both layouts' ms, today's over the kept copy's, the max diff."""
    keyed = {(r["projection"], r["rows"], r["backend"], r["layout"]): r for r in rows}
    lines = [(name, count, backend, row["ms"], kept["ms"], row["ms"] / kept["ms"], f"{row['max_diff']:.3g}")
             for (name, count, backend, layout), row in keyed.items() if layout == TODAY
             for kept in (keyed[(name, count, backend, KEPT)],)]
    return markdown_table(["projection", "rows", "backend", f"{TODAY} ms", f"{KEPT} ms", "today / kept",
                           "max |diff|"], lines)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 64, 128, 256])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    meta = run_meta("gemm_layouts", sys.argv[1:] if argv is None else argv, "cuda")
    rows = [r for count in args.rows for r in time_layouts(count, args.iters)]
    print(header(meta))
    print(table(rows))
    if args.json:
        write(args.json, meta, rows)
    return rows


if __name__ == "__main__":
    main()

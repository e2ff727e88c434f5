"""The fused loss's non-GEMM part: the JSD kernel over one chunk of loss positions, against its PyTorch reference
and against kernels of other source trees, interleaved in one process.

A chunk is ``--rows`` positions of ``--vocab`` logits (the packed path's kernel chunk: ``loss_chunk_size`` x
``fused_loss.KERNEL_CHUNK_FACTOR`` = 2,048 positions at the defaults; Qwen2.5's 151,936 entries), student and
teacher drawn seeded (normal x 3, in ``--dtype``). Each candidate is checked against the float32 reference first
(summed divergence, relative; the gradient it writes over the student's logits, largest absolute difference),
then timed by the harness's rounds (a warm-up call, then rounds alternating; the timed calls reuse one buffer,
which holds the previous call's gradient: the kernel does the same work on any finite values). Columns: ms a
chunk (median), effective GB/s (bytes the kernel's passes must move: two or three reads of both rows and one
write of the gradient) against the measured copy rate, and the ms this costs an RL step of ``--step-positions``
loss positions (the uniform cell's 261,026 response tokens).

``--configs BLOCKxWARPS ...`` adds every kernel at other launch parameters (the default: ``jsd.BLOCK`` x
``jsd.WARPS``); ``--kernel LABEL=PATH`` adds the ``jsd_rows`` of another ``jsd_kernel.py`` (an older commit's, ``git show
COMMIT:rollout/ops/jsd_kernel.py > PATH``), launched with the arguments its signature names.

  python -m benchmarks.jsd [--betas 0.5 0 1] [--rows 2048] [--kernel old=PATH] [--reference] [--json out.json]
  TRITON_INTERPRET=1 python -m benchmarks.jsd --device cpu --interpret --rows 4 --vocab 3000 --repeats 1
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import statistics
import sys
from dataclasses import dataclass

import torch

from benchmarks.harness import results
from benchmarks.harness.cli import finite_number, int_at_least, int_tuple, out_path
from benchmarks.harness.device import measure_rates, rates_meta
from benchmarks.harness.meta import header, run_meta
from benchmarks.harness.models import default_device, device_arg
from benchmarks.harness.rounds import Rounds, Timer, time_rounds
from benchmarks.harness.table import markdown_table
from rollout.ops import jsd
from rollout.opsd.losses import _chunk_divergence

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: Reads of both rows per element, by kernel mode (0: forward KL, 1: reverse KL, 2: the generalized JSD).
PASSES = {0: 2, 1: 3, 2: 3}


@dataclass
class JsdRow:
    beta: float
    candidate: str
    rows: int
    vocab: int
    dtype: str
    ms: float
    spread_ms: float
    gbps: float
    copy_fraction: float
    step_ms: float
    loss_rel_diff: float
    grad_max_diff: float


def load_kernel(path: str):
    """The ``jsd_rows`` of a kernel file (a Triton ``JITFunction``, for :func:`_launcher`)."""
    spec = importlib.util.spec_from_file_location(f"jsd_kernel_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.jsd_rows


def _launcher(kernel, block: int, warps: int):
    """Launch ``kernel`` (a ``jsd_rows``) with the arguments its signature names, from one set of values: the
    kernels of different commits differ in their scalars (older ones take log beta and log(1 - beta) too)."""
    names = list(kernel.arg_names)

    def launch(student, teacher, beta, temperature, scale, write_grad):
        losses = torch.empty(student.shape[0], dtype=torch.float32, device=student.device)
        inner = 0.0 < beta < 1.0
        values = {"s_ptr": student, "t_ptr": teacher, "loss_ptr": losses, "stride_s": student.stride(0),
                  "stride_t": teacher.stride(0), "vocab": student.shape[1], "inv_tau": 1.0 / temperature,
                  "scale": float(scale), "beta": float(beta), "log_beta": math.log(beta) if inner else 0.0,
                  "log_1m_beta": math.log1p(-beta) if inner else 0.0, "MODE": jsd.mode(beta),
                  "WRITE_GRAD": write_grad, "BLOCK": block}
        missing = [name for name in names if name not in values]
        if missing:
            raise ValueError(f"--kernel: jsd_rows takes arguments this benchmark does not know: {missing}")
        kernel[(student.shape[0],)](**{name: values[name] for name in names}, num_warps=warps)
        return losses
    return launch


def this_tree(interpret: bool):
    def launch(student, teacher, beta, temperature, scale, write_grad):
        return jsd.jsd_rows(student, teacher, beta, temperature, scale, write_grad=write_grad, fallback=None,
                            interpret=interpret)
    return launch


def reference(student, teacher, beta, temperature, scale, write_grad):
    """The PyTorch path the fused loss runs where the kernel cannot (float32 temporaries of ``[C, V]``)."""
    loss, grad = _chunk_divergence(student.float(), teacher.float(), beta, temperature, write_grad)
    if grad is not None:
        student.copy_(grad * scale)
    return loss


def measure(beta: float, candidates: dict, args, device, copy_bytes_s: float) -> list[JsdRow]:
    gen = torch.Generator().manual_seed(args.seed)
    dtype = DTYPES[args.dtype]
    student = (torch.randn(args.rows, args.vocab, generator=gen) * 3).to(device, dtype)
    teacher = (torch.randn(args.rows, args.vocab, generator=gen) * 3).to(device, dtype)
    want_loss, want_grad = _chunk_divergence(student.float(), teacher.float(), beta, args.temperature, True)
    scale = 1.0 / args.rows
    checks = {}
    for name, fn in candidates.items():
        written = student.clone()
        loss = fn(written, teacher, beta, args.temperature, scale, True).sum()
        checks[name] = (abs(float(loss) - float(want_loss)) / max(abs(float(want_loss)), 1e-30),
                        float((written.float() - want_grad * scale).abs().max()))
    del want_grad
    buffer = student.clone()
    fns = {name: (lambda fn=fn: fn(buffer, teacher, beta, args.temperature, scale, True)) for name, fn in
           candidates.items()}
    times = time_rounds(fns, Rounds(args.repeats), Timer(str(device)))
    element = torch.finfo(dtype).bits // 8
    moved = args.rows * args.vocab * element * (2 * PASSES[jsd.mode(beta)] + 1)
    out = []
    for name, samples in times.items():
        ms = statistics.median(samples)
        out.append(JsdRow(beta, name, args.rows, args.vocab, args.dtype, ms, max(samples) - min(samples),
                          moved / ms / 1e6, moved / ms * 1e3 / copy_bytes_s, ms * args.step_positions / args.rows,
                          *checks[name]))
    return out


def main(argv=None) -> list[JsdRow]:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.jsd", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", type=device_arg, default=default_device())
    parser.add_argument("--betas", type=float, nargs="+", default=[0.5])
    parser.add_argument("--rows", type=int_at_least(1), default=2048)
    parser.add_argument("--vocab", type=int_at_least(1), default=151936)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--temperature", type=finite_number(0.0, above=True), default=1.0)
    parser.add_argument("--step-positions", type=int_at_least(1), default=261026)
    parser.add_argument("--repeats", type=int_at_least(1), default=15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kernel", action="append", default=[], metavar="LABEL=PATH",
                        help="also time the jsd_rows of this kernel file")
    parser.add_argument("--configs", nargs="*", default=[], metavar="BLOCKxWARPS",
                        help="also time every kernel with these launch parameters (e.g. 8192x8)")
    parser.add_argument("--reference", action="store_true", help="also time the PyTorch reference")
    parser.add_argument("--interpret", action="store_true",
                        help="run the kernels on a CPU in Triton's interpreter (with TRITON_INTERPRET=1 set): a check")
    parser.add_argument("--json", type=out_path, help="also write the result file here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    for beta in args.betas:
        if not 0.0 <= beta <= 1.0:
            parser.error(f"--betas: each must be in [0, 1]; got {beta}")
    configs = []
    for config in args.configs:
        try:
            block, warps = int_tuple(2, sep="x")(config)  # the shared rules for a command line's ints
        except argparse.ArgumentTypeError:
            block = warps = 0
        if not (block > 0 and block & (block - 1) == 0 and warps in (1, 2, 4, 8, 16, 32)):
            parser.error(f"--configs: expected BLOCKxWARPS, BLOCK a power of two, WARPS 1..32; got {config!r}")
        configs.append((config, block, warps))
    kernels = []
    for spec in args.kernel:
        label, sep, path = spec.partition("=")
        if not sep or not label or not path:
            parser.error(f"--kernel: expected LABEL=PATH; got {spec!r}")
        kernels.append((label, path))
    candidates = {}
    probe = torch.empty(1, 1, device=device)
    reason = jsd.unsupported_reason(probe, probe, interpret=args.interpret)
    if reason is None:
        from rollout.ops import jsd_kernel
        candidates["kernel (this tree)"] = this_tree(args.interpret)
        for config, block, warps in configs:
            candidates[f"kernel (this tree, {config})"] = _launcher(jsd_kernel.jsd_rows, block, warps)
        for label, path in kernels:
            other = load_kernel(path)
            candidates[f"kernel ({label})"] = _launcher(other, jsd.BLOCK, jsd.WARPS)
            for config, block, warps in configs:
                candidates[f"kernel ({label}, {config})"] = _launcher(other, block, warps)
    else:
        print(f"# the kernel cannot run here ({reason}): the reference alone", flush=True)
    if args.reference or not candidates:
        candidates["PyTorch reference"] = reference
    rates = measure_rates(str(device), DTYPES[args.dtype])
    rows = [row for beta in args.betas for row in measure(beta, candidates, args, device, rates.copy_bytes_s)]
    meta = run_meta("jsd", argv, args.device, repeats=args.repeats, **rates_meta(rates))
    print(f"{header(meta)}; {args.rows} x {args.vocab} {args.dtype}, median of {args.repeats}; copy rate "
          f"{rates.copy_bytes_s / 1e9:.0f} GB/s")
    print(markdown_table(
        ["beta", "candidate", "ms a chunk (spread)", "GB/s (of copy)", "ms an RL step", "loss rel diff",
         "grad max diff"],
        [[r.beta, r.candidate, f"{r.ms:.3f} ({r.spread_ms:.3f})", f"{r.gbps:,.0f} ({100 * r.copy_fraction:.0f}%)",
          f"{r.step_ms:.1f}", f"{r.loss_rel_diff:.1e}", f"{r.grad_max_diff:.1e}"] for r in rows]))
    if args.json:
        results.write(args.json, meta, rows)
    return rows


if __name__ == "__main__":
    main()

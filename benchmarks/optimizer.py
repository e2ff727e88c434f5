"""The student's optimizer step under each DeepSpeed wrapper: time, launches, start-up, memory and agreement.

With bf16 and ZeRO stage 0 DeepSpeed wraps a torch optimizer in its unfused mixed-precision optimizer, which loops
over parameters (copies, unscaling, clipping, casts back: thousands of launches a step); under ZeRO stage 1 (or 2) it
keeps one flat float32 partition per parameter group and steps it with a handful of multi-tensor launches. Variants:

  zero0               the built-in config at ZeRO stage 0 (``rollout.opsd.engines.deepspeed_config``)
  zero1               the same at ZeRO stage 1
  zero1-fp32-accum    ZeRO stage 1 with ``data_types.grad_accum_dtype = fp32`` (DeepSpeed's BF16_Optimizer)

Each variant runs in its own process (ABBA order over ``--rounds``), on the same seeded random student: engine
build time (``deepspeed.initialize``, synchronised), then per step a forward + backward of one ``--tokens`` row and
the optimizer step alone timed with CUDA events (GPU ms) and the host clock (wall ms, synchronised after), one step
profiled for its kernel launches, the peak memory, and a sample of the updates (weights after ``--steps`` steps minus
the initial ones, the first elements of the first parameters), compared with the first ``zero0`` process (relative L2
of the update per sampled parameter: the median and the largest; ``zero0`` against itself is the noise floor).

  python -m benchmarks.optimizer --student qwen25-3b --steps 8 --rounds 2 --out docs/results/<dir>/optimizer.json

``--lr`` (AdamW, default 1e-3) must move the bf16 weights by more than their spacing (about 2^-8 of a weight) over
the run, or the comparison measures rounding flips only (at 1e-5 the updates stay below it).

Time nothing in a machine's first process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from benchmarks.harness import results
from benchmarks.harness.cli import finite_number, int_at_least, int_in, out_path
from benchmarks.harness.meta import header, run_meta
from benchmarks.harness.rounds import round_order
from benchmarks.harness.table import markdown_table
from rollout.opsd.ds_config_checks import MAX_LR

VARIANTS = {"zero0": (0, None), "zero1": (1, None), "zero1-fp32-accum": (1, "fp32")}
#: Parameters whose first elements are kept for the agreement check.
SAMPLED_PARAMS = 8
SAMPLE_ELEMENTS = 1 << 16


def _config(variant: str, cuda: bool) -> dict:
    from rollout.opsd.engines import deepspeed_config

    stage, accum = VARIANTS[variant]
    config = deepspeed_config(None, stage, 1, cuda)
    if accum is not None:
        config["data_types"] = {"grad_accum_dtype": accum}
    return config


def _kernels_in(fn) -> int:
    """Kernels ``fn`` launches (one profiled call)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def child(args) -> dict:
    """One variant in this process: the figures of the module docstring, as a dict."""
    from benchmarks.harness.models import set_single_process_env
    from rollout.opsd.engines import init_distributed, make_student_engine
    from rollout.testing import shaped_model, tiny_model

    set_single_process_env(args.port)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    init_distributed()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    dtype = torch.bfloat16 if cuda else torch.float32
    model = tiny_model("qwen2", seed=0).to(device, dtype) if args.student == "tiny" \
        else shaped_model(args.student, seed=0, dtype=dtype, device=device)
    model.train()
    sync()
    began = time.perf_counter()
    engine = make_student_engine(model, _config(args.child, cuda), lora=None, lr=args.lr)
    sync()
    build_s = time.perf_counter() - began
    named = [(n, p) for n, p in engine.module.named_parameters()][:SAMPLED_PARAMS]
    initial = {n: p.detach().float().flatten()[:SAMPLE_ELEMENTS].cpu() for n, p in named}
    ids = torch.randint(3, model.config.vocab_size, (1, args.tokens), device=device,
                        generator=torch.Generator(device).manual_seed(0))

    def forward_backward():
        logits = engine(input_ids=ids).logits
        engine.backward(logits.float().logsumexp(-1).mean())

    gpu_ms, wall_ms, launches = [], [], None  # step 0 (allocates the state) timed apart, step 1 profiled
    for index in range(args.steps):
        forward_backward()
        sync()
        if index == 1:  # a step after the first (which allocates the optimizer's state)
            launches = _kernels_in(engine.step)
            continue
        start, end = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else (None,) * 2
        began = time.perf_counter()
        if cuda:
            start.record()
        engine.step()
        if cuda:
            end.record()
        sync()
        wall_ms.append((time.perf_counter() - began) * 1e3)
        if cuda:
            gpu_ms.append(start.elapsed_time(end))
    sample = {n: p.detach().float().flatten()[:SAMPLE_ELEMENTS].cpu() - initial[n] for n, p in named}
    torch.save(sample, args.sample)
    return {"variant": args.child, "optimizer": type(engine.optimizer).__name__, "build_s": build_s,
            "step_gpu_ms": statistics.median(gpu_ms[1:]) if len(gpu_ms) > 1 else None,
            "step_wall_ms": statistics.median(wall_ms[1:]), "first_step_wall_ms": wall_ms[0],
            "kernels_per_step": launches, "steps": args.steps,
            "peak_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else None,
            "timed_steps": len(wall_ms) - 1}


def _rel_l2(a: dict, b: dict) -> dict:
    """Relative L2 of the updates ``a`` against ``b`` per sampled parameter: the median and the largest (named)."""
    per = {k: float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-30)) for k in b}
    worst = max(per, key=per.get)
    return {"median": statistics.median(per.values()), "max": per[worst], "max_param": worst}


def parent(args, argv) -> None:
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        raise SystemExit(f"--variants: {unknown or variants} not among {tuple(VARIANTS)}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    meta = run_meta("optimizer", argv, device)
    print(header(meta), flush=True)
    rows, samples, reference = [], {}, None
    with tempfile.TemporaryDirectory() as folder:
        for round_index in range(args.rounds):
            for variant in round_order(variants, round_index):
                path = os.path.join(folder, f"{variant}-{round_index}.pt")
                cmd = [sys.executable, "-m", "benchmarks.optimizer", "--child", variant, "--sample", path,
                       "--student", args.student, "--steps", str(args.steps), "--tokens", str(args.tokens),
                       "--lr", str(args.lr), "--port", str(args.port + 1 + len(rows))]
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode != 0:
                    print(f"  {variant} round {round_index}: exit {done.returncode}\n{done.stderr[-3000:]}", flush=True)
                    continue
                row = json.loads(done.stdout.strip().splitlines()[-1])
                row["round"] = round_index
                samples[(variant, round_index)] = torch.load(path)
                if reference is None and variant == "zero0":
                    reference = (variant, round_index)
                rows.append(row)
                print(f"  {variant} round {round_index}: {row}", flush=True)
        for row in rows:
            key = (row["variant"], row["round"])
            row["rel_l2_vs_zero0"] = None if reference is None or key == reference \
                else _rel_l2(samples[key], samples[reference])
    if args.out:
        results.write(args.out, meta, rows)
    print(table(rows))


def table(rows: list) -> str:
    """Medians per variant over its processes."""
    out = []
    for variant in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == variant]
        med = lambda key: statistics.median(r[key] for r in mine) if all(r.get(key) is not None for r in mine) \
            else None
        rel = [r["rel_l2_vs_zero0"] for r in mine if r.get("rel_l2_vs_zero0") is not None]
        worst = max(rel, key=lambda x: x["max"]) if rel else None
        out.append([variant, mine[0]["optimizer"], len(mine), med("build_s"), med("step_gpu_ms"), med("step_wall_ms"),
                    med("first_step_wall_ms"), med("kernels_per_step"), med("peak_gib"),
                    max(x["median"] for x in rel) if rel else None,
                    f'{worst["max"]:.3g} ({worst["max_param"]})' if worst else None])
    return markdown_table(["variant", "DeepSpeed optimizer", "processes", "engine build s", "step GPU ms",
                           "step wall ms", "first step wall ms", "kernels / step", "peak GiB",
                           "update rel. L2 vs zero0, median", "largest (parameter)"], out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--student", default="qwen25-3b")
    parser.add_argument("--steps", type=int_at_least(4), default=6, help="optimizer steps per process (two untimed)")
    parser.add_argument("--tokens", type=int_at_least(2), default=256, help="tokens of the one row each step trains on")
    parser.add_argument("--lr", type=finite_number(0.0, above=True, high=MAX_LR), default=1e-3,
                        help="AdamW's rate: updates must exceed bf16's spacing for the comparison to mean anything")
    parser.add_argument("--rounds", type=int_at_least(1), default=2, help="processes per variant, ABBA order")
    parser.add_argument("--port", type=int_in(1, 65535), default=29610)
    parser.add_argument("--out", type=out_path, default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--sample", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 4:
        parser.error("--steps: at least 4 (two untimed, two timed)")
    if args.child is not None:
        print(json.dumps(child(args)), flush=True)
    else:
        parent(args, argv if argv is not None else sys.argv[1:])


if __name__ == "__main__":
    main()

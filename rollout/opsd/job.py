"""The main job's settings (``scripts/train_opsd.py``): what to train, on what, for how long, and how its
rollout runs (:class:`JobConfig`; loss settings live in ``OPSDConfig``), and the model names it knows besides HF repo
ids and local paths (:class:`ModelNames`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Mapping, Optional

from rollout.checks import is_int, is_number, require
from rollout.config import MAX_SEED, RolloutConfig
from rollout.opsd.ds_config_checks import MAX_LR

#: ``--teacher self``: the student distils from itself.
SELF_TEACHER = "self"
#: The embedded models used when ``--student`` / ``--teacher`` are left out (their shape names).
DEFAULT_STUDENT, DEFAULT_TEACHER = "tiny-qwen2", "tiny-llama"
#: A local model directory holds one of these (a peft adapter's directory names its base model in the second).
MODEL_FILES = ("config.json", "adapter_config.json")
#: Most prompts a run draws (``steps x batch_size``): each one's length is drawn before step 0 (8 bytes each).
MAX_PROMPTS = 2**25


def _is_count(value, least: int) -> bool:
    return is_int(value) and value >= least


@dataclass(frozen=True)
class JobConfig:
    """What to train, on what, for how long, and how the rollout runs (loss settings live in ``OPSDConfig``)."""

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
    """Training steps (``steps x batch_size`` at most ``MAX_PROMPTS``, 2**25); each step's prompts are built when it
    starts."""
    lr: Optional[float] = None
    """AdamW learning rate (ignored when the DeepSpeed config defines an optimizer); None: the
    student's default (1e-5 for ``smollm2-135m``, 5e-3 for the random models)."""
    seed: int = 0
    """Seed of the models, prompts and sampling, in ``[0, 2**32)`` (each rank and step derives its own sampling seed
    in that range: ``rollout.job.step_seed``)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """How the rollout runs: one ``RolloutConfig``, handed whole to the step's ``Rollout``. Its common settings
    have flags of their own (``--route``, ``--gather``, ``--keep-cache``, ``--max-cache-gib``), the others come
    by their dotted names (``--rollout kernels.cuda_graphs=False``; :mod:`rollout.opsd.flags`)."""
    teacher_offload: int = 0
    """1: the teacher runs in an inference-only DeepSpeed ZeRO-3 engine with its parameters offloaded
    to host memory (for teachers larger than the student)."""
    json_out: Optional[str] = None
    """Where rank 0 writes the run's JSON report (every rank's figures); None writes none."""
    peak_tflops: Optional[float] = None
    """The device's peak FLOP/s (TFLOP/s) that MFU divides by; None: the data-sheet figure of a listed GPU
    (``instrumentation.mfu.PEAK_TFLOPS``), no MFU elsewhere (the CPU included). Given, it also sets
    ``OPSD_PEAK_TFLOPS`` for the profiler's work rooflines (``instrumentation.rates``)."""
    peak_tbps: Optional[float] = None
    """The device's copy rate (TB/s, bytes read + written) the profiler's work rooflines divide by: sets
    ``OPSD_PEAK_TBPS`` (``instrumentation.rates``); None: measured on the GPU, else a listed GPU's data sheet."""
    print_every: int = 2
    """Print the first two rollout rows decoded at step 1 and every this many steps after it, and at
    the last step (tokenizers that decode only, e.g. ``smollm2-135m``); 0 prints none."""

    def __post_init__(self) -> None:
        for name in ("batch_size", "samples_per_prompt", "max_new_tokens", "prompt_len", "steps"):
            value = getattr(self, name)
            require(_is_count(value, 1), name, f"must be an int >= 1; got {value!r}")
        require(self.steps * self.batch_size <= MAX_PROMPTS, "steps",
                f"--steps x --batch-size = {self.steps * self.batch_size} prompts exceed {MAX_PROMPTS} (2**25), "
                "the most a run draws")
        require(is_int(self.seed) and 0 <= self.seed < MAX_SEED, "seed",
                f"must be an int in [0, 2**32); got {self.seed!r}")
        require(is_number(self.sampling_temperature), "sampling_temperature",
                f"must be a finite number (<= 0: greedy); got {self.sampling_temperature!r}")
        require(self.zero_stage in (None, 0, 1, 2, 3), "zero_stage", f"must be 0, 1, 2 or 3; got {self.zero_stage!r}")
        require(self.lora is None or _is_count(self.lora, 1), "lora", f"must be a LoRA rank >= 1; got {self.lora!r}")
        require(self.lr is None or (isinstance(self.lr, (int, float)) and math.isfinite(self.lr)
                                    and 0 < self.lr <= MAX_LR),
                "lr", f"must be a finite number in (0, {MAX_LR:g}] (AdamW's float32 step overflows above it); "
                      f"got {self.lr!r}")
        require(self.peak_tflops is None or (is_number(self.peak_tflops) and self.peak_tflops > 0),
                "peak_tflops", f"must be a finite number > 0; got {self.peak_tflops!r}")
        require(self.peak_tbps is None or (is_number(self.peak_tbps) and self.peak_tbps > 0),
                "peak_tbps", f"must be a finite number > 0; got {self.peak_tbps!r}")
        require(_is_count(self.print_every, 0), "print_every", f"must be an int >= 0; got {self.print_every!r}")
        require(self.teacher_offload in (0, 1) and not isinstance(self.teacher_offload, bool), "teacher_offload",
                f"must be 0 or 1; got {self.teacher_offload!r}")
        require(isinstance(self.rollout, RolloutConfig), "rollout",
                f"must be a RolloutConfig; got {type(self.rollout).__name__}")
        require(self.deepspeed_config is None or os.path.isfile(self.deepspeed_config), "deepspeed_config",
                f"{self.deepspeed_config!r} is a directory; name a JSON file"
                if self.deepspeed_config and os.path.isdir(self.deepspeed_config) else
                f"no such file {self.deepspeed_config!r}")
        require(not (self.teacher_offload and self.teacher == SELF_TEACHER), "teacher_offload",
                "the student cannot be offloaded as its own teacher (--teacher self)")


@dataclass(frozen=True)
class ModelNames:
    """The model names the job knows besides HF repo ids (``org/name``) and local paths. They live above
    this layer (``rollout.testing.MODEL_SHAPES``, ``rollout.real_model``): ``rollout.job`` passes them in."""

    vocab_sizes: Mapping[str, int]
    """Shape name (a random model of that geometry) -> its vocabulary size."""
    real: str
    """The real chat model's name: it distils only from itself."""

    def check(self, job: JobConfig) -> None:
        """ValueError naming the field unless the job's student and teacher are models it can build, and the
        teacher can score every token the student samples."""
        self.check_name("student", job.student)
        self.check_name("teacher", job.teacher)
        self.check_real_pair(job.student, job.teacher)
        student_vocab = self.vocab_sizes.get(job.student or DEFAULT_STUDENT)
        teacher_vocab = self.vocab_sizes.get(job.teacher or DEFAULT_TEACHER)
        require(student_vocab is None or teacher_vocab is None or teacher_vocab >= student_vocab, "teacher",
                f"the vocabulary of {job.teacher or DEFAULT_TEACHER!r} ({teacher_vocab}) is smaller than the "
                f"student's ({student_vocab}); it cannot score every token the student samples")

    def check_name(self, field: str, name: Optional[str]) -> None:
        """ValueError naming ``field`` unless ``name`` is None, a shape name, the real model, ``self``
        (teacher), an existing directory, or an HF repo id (``org/name``) that is no existing file."""
        if name is None or name in self.vocab_sizes or name == self.real or (field == "teacher"
                                                                              and name == SELF_TEACHER):
            return
        require(isinstance(name, str) and name.strip(), field, f"must be a model name; got {name!r}")
        require(not os.path.exists(name) or os.path.isdir(name), field,
                f"--{field} {name!r} is a file, not a model directory (config.json and weights), a shape name or an "
                "HF repo id")
        require(not os.path.isdir(name) or any(os.path.isfile(os.path.join(name, marker)) for marker in MODEL_FILES),
                field, f"--{field} {name!r} is a directory without config.json (nor a peft adapter_config.json): not a "
                "model directory")
        if os.path.exists(name) or "/" in name:
            return
        extra = ", 'self'" if field == "teacher" else ""
        raise ValueError(f"{field}: {name!r} is neither a shape name ({', '.join(sorted(self.vocab_sizes))}{extra}), "
                         f"the real model {self.real!r}, an existing local directory, nor an HF repo id 'org/name'")

    def check_real_pair(self, student: Optional[str], teacher: Optional[str]) -> None:
        """ValueError naming the teacher unless the real model is paired with itself (``self`` or a copy):
        its tokenizer gives token ids meaning nothing to a random model, and the reverse."""
        if self.real not in (student, teacher):
            return
        require(student == self.real and teacher in (SELF_TEACHER, self.real), "teacher",
                f"{self.real!r} distils only from itself: --student {self.real} with --teacher self or "
                f"--teacher {self.real}; got student {student or DEFAULT_STUDENT!r}, "
                f"teacher {teacher or DEFAULT_TEACHER!r}")

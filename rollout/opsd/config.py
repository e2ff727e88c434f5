"""Settings and result records of the OPSD step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from rollout.checks import is_int, is_number, require
from rollout.opsd.logit_cache import LOCATIONS, LogitCacheConfig
from rollout.opsd.breakdown import StepBreakdown
from rollout.opsd.losses import DEFAULT_CHUNK_SIZE
from rollout.opsd.micro_batches import AUTO
from rollout.request import RolloutBatch


def _is_count(value) -> bool:
    return is_int(value) and value >= 1


#: The settings of ``OPSDConfig.train_path``.
TRAIN_PATHS = ("auto", "packed", "padded")
#: ``OPSDConfig.temperature`` must lie in this range: below it, logits / temperature overflow float32 (a NaN or a
#: saturated loss of ln 2); above it, both softmaxes are flat to within float32 rounding for logits of ordinary size,
#: so the loss and its gradient carry no signal (the loss reads 0).
LOSS_TEMPERATURE_RANGE = (1e-6, 1e6)


@dataclass(frozen=True)
class OPSDConfig:
    """Loss and teacher-cache settings of the OPSD step (sampling is passed to each ``step``)."""

    beta: float = 0.5
    """Generalized JSD interpolation in [0, 1]: 0 forward KL(teacher||student), 1 reverse KL."""
    temperature: float = 1.0
    """Loss temperature, in :data:`LOSS_TEMPERATURE_RANGE` ([1e-6, 1e6]): both logits are divided by it before the
    softmax."""
    teacher_top_k: Optional[int] = None
    """Cache only the teacher's top-k logits per position (both distributions renormalised over
    those ids; >= 2: over one id both are 1 and the loss is 0); None caches the full (shared) vocabulary."""
    logit_cache_location: str = "device"
    """``"device"``: the cache stays on the teacher's device; ``"host"``: host memory (pinned when
    CUDA is available, copied with ``non_blocking=True``)."""
    logit_cache_dtype: torch.dtype = torch.bfloat16
    """Storage dtype of the cached teacher logits (the loss computes in float32)."""
    loss_chunk_size: int = DEFAULT_CHUNK_SIZE
    """Response positions per loss chunk (bounds the float32 temporaries of the loss)."""
    max_student_rows: Union[int, str, None] = AUTO
    """Rows per student micro-batch (forward + loss + backward; gradients accumulate, one optimizer
    step per OPSD step; bounds the student's ``[rows, k, V]`` logits and its activations).
    ``"auto"``: as many as fit ``max_micro_batch_gib`` by the estimate of :mod:`rollout.opsd.sizing`;
    an int >= 1: at most that many; None: all rows at once."""
    max_teacher_rows: Union[int, str, None] = AUTO
    """Rows per teacher forward (bounds the teacher's ``[rows, k, V]`` logits and the cache held).
    ``"auto"``: the student's micro-batch, each teacher forward right before the micro-batch that
    reads it (at most one micro-batch of teacher logits is cached at a time); an int >= 1: at most
    that many; None: all rows in one forward (the whole batch's cache is held)."""
    max_micro_batch_gib: Optional[float] = None
    """Memory one micro-batch may use under ``max_student_rows="auto"`` (activations kept for backward,
    logits, cache); None: 60% of the device memory free when the distillation starts (CUDA; 45% on the
    packed path), 8 GiB on the CPU (see :mod:`rollout.opsd.sizing`)."""

    train_path: str = "auto"
    """How the teacher and student passes run: ``"packed"`` (each micro-batch's rows packed into one sequence
    with variable-length attention, no padding; the teacher caches its final hidden states at the loss
    positions and the loss applies both heads chunk by chunk: :mod:`rollout.opsd.packed`,
    :mod:`rollout.opsd.fused_loss`), ``"padded"`` (HF's forward over ``[rows, columns]`` with a mask, logits
    and a logit cache), or ``"auto"``: packed where it is supported (a Llama/Qwen2/Qwen3/Mistral-type model
    with a bias-free linear head, no top-k cache; ZeRO-3 included: the fused loss calls the student's head through its
    module, so its weight is gathered there), padded otherwise. The step reports
    the path it took (``StepBreakdown.train_path``)."""

    fast_teacher: bool = True
    """On the packed path, run the teacher's forward through the rollout's own decoder pieces (fused norms, rotary
    and MLP, ``torch.compile``d on CUDA; :func:`rollout.opsd.fast_passes.fast_loss_hidden`) where they cover the
    model, a peft LoRA teacher's adapters included (a LoRA student distilling from itself); False, or a model they do
    not cover (a LoRA variant such as DoRA, ZeRO-3), runs HF's forward with the packed attention.
    ``StepBreakdown.teacher_path`` says which ran."""

    fast_student: bool = True
    """On the packed path, run the student's forward (and so its backward) through the same pieces over its
    parameters, with autograd (:func:`rollout.opsd.fast_passes.student_decoder`; compiled forward and backward on
    CUDA). A peft LoRA student runs the LoRA pieces: its frozen base weights plus each projection's adapter, as
    peft's unmerged forward computes them (gradients reach the adapters only). A ZeRO-3 student runs them too where
    its rollout gathers once (``RolloutConfig.gather="once"``, the default): the step gathers its parameters once for
    the micro-batches' passes, ZeRO-3's module hooks suspended, and partitions them again before the optimizer step;
    the micro-batches' gradients are reduced once, after the last (``coalesce_gradients``). False, or a model they do not cover
    (ZeRO-3 with ``gather="per_forward"``, activation checkpointing, attention dropout; LoRA variants such as DoRA, ``lora_bias``,
    lora dropout in training, several active adapters on a layer, adapters outside the decoder layers'
    projections), runs HF's forward with the packed attention. ``StepBreakdown.student_path`` says which ran;
    ``OPSDStep.student_path_reason`` why."""

    coalesce_gradients: bool = True
    """A ZeRO-3 student gathered once for its passes (above) leaves each micro-batch's gradients on its gathered
    parameters and reduces them into ZeRO-3's partitions once, after the last micro-batch (DeepSpeed's
    ``engine.coalesce_grad_reduction``), instead of in ZeRO-3's gradient hooks after every micro-batch, whose host
    work and stream syncs left the GPU idle. Costs the full gradients' memory (2 bytes a bf16 parameter) during the
    step, which the micro-batch budget leaves to its headroom (3B at RL scale on an H200: peak 95.0 GiB against 89.3),
    and accumulates them in the parameters' dtype, as ZeRO-0 does. False: the hooks reduce each micro-batch into
    ZeRO-3's partitions. ``OPSDStep.coalesces_gradients`` says whether it applies."""

    def __post_init__(self) -> None:
        for name in ("fast_teacher", "fast_student", "coalesce_gradients"):
            require(isinstance(getattr(self, name), bool), name, f"must be a bool; got {getattr(self, name)!r}")
        require(self.train_path in TRAIN_PATHS, "train_path",
                f"must be one of {TRAIN_PATHS}; got {self.train_path!r}")
        require(is_number(self.beta) and 0.0 <= self.beta <= 1.0, "beta", f"must be in [0, 1]; got {self.beta!r}")
        low, high = LOSS_TEMPERATURE_RANGE
        require(is_number(self.temperature) and low <= self.temperature <= high, "temperature",
                f"must be a finite number in [{low:g}, {high:g}] (below, logits / temperature overflow float32; "
                f"above, both softmaxes are flat and the loss is 0); got {self.temperature!r}")
        require(self.teacher_top_k is None or (_is_count(self.teacher_top_k) and self.teacher_top_k >= 2),
                "teacher_top_k", f"must be None or an int >= 2 (over one id both distributions are 1 and the loss "
                                 f"is 0); got {self.teacher_top_k!r}")
        require(self.logit_cache_location in LOCATIONS, "logit_cache_location",
                 f"must be one of {LOCATIONS}; got {self.logit_cache_location!r}")
        require(isinstance(self.logit_cache_dtype, torch.dtype) and self.logit_cache_dtype.is_floating_point,
                 "logit_cache_dtype", f"must be a floating torch.dtype; got {self.logit_cache_dtype!r}")
        require(_is_count(self.loss_chunk_size), "loss_chunk_size",
                 f"must be an int >= 1; got {self.loss_chunk_size!r}")
        for name in ("max_student_rows", "max_teacher_rows"):
            value = getattr(self, name)
            require(value is None or value == AUTO or _is_count(value), name,
                     f"must be 'auto', None or an int >= 1; got {value!r}")
        require(self.max_micro_batch_gib is None or (is_number(self.max_micro_batch_gib)
                                                     and self.max_micro_batch_gib > 0), "max_micro_batch_gib",
                 f"must be None or a finite number > 0; got {self.max_micro_batch_gib!r}")

    def cache_config(self) -> LogitCacheConfig:
        """The teacher logit cache settings."""
        return LogitCacheConfig(self.teacher_top_k, self.logit_cache_location, self.logit_cache_dtype)


@dataclass(frozen=True)
class StepResult:
    """What one step did (host values; one sync per step produces them)."""

    loss: float
    """This rank's loss: the mean divergence over its response positions."""
    num_response_tokens: int
    """Response positions in this rank's loss (generated tokens with mask 1)."""
    step_ms: float
    """Wall time of the whole step on the host."""
    rollout_ms: Optional[float]
    """Wall time of the rollout (None for :meth:`OPSDStep.train_on_batch`)."""
    rollout_tokens_per_s: Optional[float]
    """Response tokens (mask 1, padding excluded) generated per second of rollout wall time."""
    rollout_profile: Optional[dict]
    """``Rollout.get_last_profile()`` of this step's rollout (None when profiling is off)."""
    batch: Optional[RolloutBatch]
    """The rollout the step trained on (prompt + response ids and masks); None in the records the main job keeps
    (``scripts/train_opsd.py``'s ``train``: a step's tensors must not live for the whole run)."""
    breakdown: StepBreakdown
    """Per-phase host and GPU times, peak memory per phase, and the micro-batching of the step."""

"""The OPSD training step: rollout -> teacher forward + logit cache -> student forward -> loss -> update.

``OPSDStep.step(prompt_ids, prompt_attention_mask, sampling)`` runs one on-policy distillation step
on a student (a DeepSpeed engine, ZeRO-0..3, optionally a peft LoRA model inside; or a plain module
with a torch optimizer) against a teacher (a plain HF model, a peft model, a DeepSpeed engine, or
the student itself for self-distillation). Each phase runs inside its ``opsd/<stage>`` range.

Alignment. The logits at position ``t`` predict token ``t + 1``. Only the last ``k = T - s + 1``
positions are computed (``logits_to_keep=k``, ``s`` the first response column): position ``s - 1``
predicts the first response token; the last kept position predicts nothing and is masked out. The
loss mask is :func:`rollout.losses.response_logit_positions` restricted to those ``k`` columns.
Position ids count real tokens (``cumsum(mask) - 1``), as in the rollout's own forwards.

Memory. No ``[B, T, V]`` logits exist: teacher and student logits are ``[B, k, V]`` in the model
dtype. Teacher logits are computed ``max_teacher_rows`` rows at a time, cached at the response
positions only (bf16 by default, on the device or in pinned host memory) and freed right away; the
cache is freed right after the loss, before backward. The loss itself is chunked (see
:mod:`rollout.losses`).

Self-distillation. Pass the student (engine or module) as ``teacher``. The teacher forward then runs
on the current weights under ``no_grad`` with the module in eval mode (each submodule's flag restored
afterwards), so it is a constant target of this step. On identical inputs teacher and student agree
and the loss is 0: pass ``teacher_prompt_ids`` (e.g. a prompt with privileged context) so that the
teacher scores the same response under a different prompt; the response is aligned by its columns.

Vocabularies. Teacher and student may differ in vocabulary size: only the shared ids
``[0, min(V_s, V_t))`` are compared (:func:`rollout.losses.align_vocab`). A teacher whose EOS/pad ids
differ from the student tokenizer's, whose tokenizer maps a shared token to another id, or whose
vocabulary does not contain every id of the batch raises ``ValueError`` naming it.

Data parallel. Each rank distils its own rollout. With more than one data-parallel rank the loss
handed to backward is scaled by ``n_rank * world / n_total`` (one all-reduce of the token count), so
DeepSpeed's gradient averaging yields the mean over all response positions of all ranks.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import time
from dataclasses import dataclass
from typing import Optional

import torch

from instrumentation import stage, stages
from rollout import compat, masks
from rollout.config import RolloutConfig, SamplingConfig, _is_int, _require
from rollout.engine import Rollout, token_ids
from rollout.expand import expand_prompts
from rollout.logit_cache import LOCATIONS, LogitCacheConfig, TeacherLogitCache
from rollout.losses import DEFAULT_CHUNK_SIZE, generalized_jsd_loss, response_logit_positions
from rollout.request import RolloutBatch, RolloutRequest

__all__ = ["OPSDConfig", "OPSDStep", "StepResult", "generalized_jsd_loss"]


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_count(value) -> bool:
    return _is_int(value) and value >= 1


@dataclass(frozen=True)
class OPSDConfig:
    """Loss and teacher-cache settings of the OPSD step (sampling is passed to each ``step``)."""

    beta: float = 0.5
    """Generalized JSD interpolation in [0, 1]: 0 forward KL(teacher||student), 1 reverse KL."""
    temperature: float = 1.0
    """Loss temperature (> 0): both logits are divided by it before the softmax."""
    teacher_top_k: Optional[int] = None
    """Cache only the teacher's top-k logits per position (both distributions renormalised over
    those ids); None caches the full (shared) vocabulary."""
    logit_cache_location: str = "device"
    """``"device"``: the cache stays on the teacher's device; ``"host"``: host memory (pinned when
    CUDA is available, copied with ``non_blocking=True``)."""
    logit_cache_dtype: torch.dtype = torch.bfloat16
    """Storage dtype of the cached teacher logits (the loss computes in float32)."""
    loss_chunk_size: int = DEFAULT_CHUNK_SIZE
    """Response positions per loss chunk (bounds the float32 temporaries of the loss)."""
    max_teacher_rows: Optional[int] = None
    """Rows per teacher forward (bounds the teacher's ``[rows, k, V]`` logits); None: all at once."""

    def __post_init__(self) -> None:
        _require(_is_number(self.beta) and 0.0 <= self.beta <= 1.0, "beta", f"must be in [0, 1]; got {self.beta!r}")
        _require(_is_number(self.temperature) and self.temperature > 0, "temperature",
                 f"must be a finite number > 0; got {self.temperature!r}")
        _require(self.teacher_top_k is None or _is_count(self.teacher_top_k), "teacher_top_k",
                 f"must be None or an int >= 1; got {self.teacher_top_k!r}")
        _require(self.logit_cache_location in LOCATIONS, "logit_cache_location",
                 f"must be one of {LOCATIONS}; got {self.logit_cache_location!r}")
        _require(isinstance(self.logit_cache_dtype, torch.dtype) and self.logit_cache_dtype.is_floating_point,
                 "logit_cache_dtype", f"must be a floating torch.dtype; got {self.logit_cache_dtype!r}")
        _require(_is_count(self.loss_chunk_size), "loss_chunk_size",
                 f"must be an int >= 1; got {self.loss_chunk_size!r}")
        _require(self.max_teacher_rows is None or _is_count(self.max_teacher_rows), "max_teacher_rows",
                 f"must be None or an int >= 1; got {self.max_teacher_rows!r}")

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
    batch: RolloutBatch
    """The rollout the step trained on (prompt + response ids and masks)."""


class _PlainStudent:
    """A plain module + torch optimizer behind the engine interface (``__call__``/``backward``/``step``)."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.module, self.optimizer = module, optimizer

    def __call__(self, **inputs):
        return self.module(**inputs)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def _is_training_engine(obj) -> bool:
    return callable(getattr(obj, "zero_optimization_stage", None)) and callable(getattr(obj, "backward", None))


def _config_token_ids(config) -> tuple[Optional[set], Optional[int]]:
    """``(eos ids or None, pad id or None)`` from a model config (None where unknown)."""
    eos = getattr(config, "eos_token_id", None)
    eos_ids = None if eos is None else set(eos if isinstance(eos, (list, tuple)) else [eos])
    return eos_ids, getattr(config, "pad_token_id", None)


@contextlib.contextmanager
def _eval_mode(module: torch.nn.Module):
    """Eval mode for a forward; every submodule's own ``training`` flag is restored afterwards."""
    flags = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, was_training in flags:
            m.training = was_training


class OPSDStep:
    """One OPSD training step per :meth:`step` call (see the module docstring).

    ``student``: a DeepSpeed engine (``optimizer`` must be None) or a plain module (``optimizer``
    required). ``teacher``: any callable model returning ``.logits``; the student itself for
    self-distillation. ``tokenizer``: the student's (pad/EOS ids for the rollout). ``teacher_tokenizer``
    (optional) is checked for alignment with it; without it the teacher config's ids are checked.
    """

    def __init__(self, student, teacher, tokenizer, config: Optional[OPSDConfig] = None, *,
                 optimizer: Optional[torch.optim.Optimizer] = None, teacher_tokenizer=None,
                 rollout_config: Optional[RolloutConfig] = None):
        self.config = OPSDConfig() if config is None else config
        _require(isinstance(self.config, OPSDConfig), "config",
                 f"must be an OPSDConfig; got {type(config).__name__}")
        if _is_training_engine(student):
            _require(optimizer is None, "optimizer", "must be None for a DeepSpeed engine (it owns its optimizer)")
            self.student = student
        else:
            _require(isinstance(student, torch.nn.Module), "student", "must be a DeepSpeed engine or a torch module")
            _require(isinstance(optimizer, torch.optim.Optimizer), "optimizer",
                     f"a plain student module needs a torch optimizer; got {type(optimizer).__name__}")
            self.student = _PlainStudent(student, optimizer)
        self.student_module = compat.unwrap_model(student)
        _require(teacher is not None, "teacher", "is required (pass the student for self-distillation)")
        self.is_self_distillation = teacher is student or compat.unwrap_model(teacher) is self.student_module
        # A training engine's forward does training bookkeeping: call its module (ZeRO-3 hooks live there).
        self.teacher = compat.unwrap_model(teacher) if _is_training_engine(teacher) else teacher
        self.rollout = Rollout(student, tokenizer, rollout_config)
        self.student_vocab_size = compat.causal_lm(self.student_module).config.vocab_size
        teacher_model = compat.causal_lm(getattr(self.teacher, "module", self.teacher))
        self.teacher_vocab_size = teacher_model.config.vocab_size
        self._teacher_keeps = "logits_to_keep" in inspect.signature(type(teacher_model).forward).parameters
        self._student_keeps = "logits_to_keep" in inspect.signature(
            type(compat.causal_lm(self.student_module)).forward).parameters
        shared_vocab = min(self.student_vocab_size, self.teacher_vocab_size)
        top_k = self.config.teacher_top_k
        _require(top_k is None or top_k <= shared_vocab, "teacher_top_k",
                 f"{top_k} exceeds the shared vocabulary size {shared_vocab}")
        _check_teacher_tokens(tokenizer, teacher_tokenizer, teacher_model.config)

    # ---- public -----------------------------------------------------------------------------
    def step(self, prompt_ids: torch.Tensor, prompt_attention_mask: torch.Tensor, sampling: SamplingConfig, *,
             teacher_prompt_ids: Optional[torch.Tensor] = None,
             teacher_prompt_attention_mask: Optional[torch.Tensor] = None) -> StepResult:
        """Rollout on ``[B, T_p]`` left-padded prompts, then distil on it (one optimizer step).

        ``teacher_prompt_*`` (``[B, T_t]``, left-padded, one per prompt) replace the prompts in the
        teacher's input; the response is the rollout's.
        """
        start = time.perf_counter()
        with stage(stages.STEP):
            request = RolloutRequest(prompt_ids, prompt_attention_mask)
            teacher_prompts = _teacher_prompts(teacher_prompt_ids, teacher_prompt_attention_mask,
                                               request.batch_size, sampling.n_samples_per_prompt)
            batch = self.rollout.generate(request, sampling)
            num_tokens = int(batch.attention_mask[:, request.prompt_len:].sum())  # a sync: the rollout is done
            rollout_s = time.perf_counter() - start
            loss, _ = self._distill(batch, teacher_prompts)
        return StepResult(loss, num_tokens, (time.perf_counter() - start) * 1e3, rollout_s * 1e3,
                          num_tokens / rollout_s if rollout_s > 0 else 0.0, self.rollout.get_last_profile(), batch)

    def train_on_batch(self, batch: RolloutBatch, *, teacher_prompt_ids: Optional[torch.Tensor] = None,
                       teacher_prompt_attention_mask: Optional[torch.Tensor] = None) -> StepResult:
        """Distil on a given rollout (e.g. from another engine): everything of :meth:`step` but the
        rollout. ``teacher_prompt_*`` are ``[N, T_t]``, one per rollout row."""
        _require(isinstance(batch, RolloutBatch), "batch", f"must be a RolloutBatch; got {type(batch).__name__}")
        start = time.perf_counter()
        with stage(stages.STEP):
            teacher_prompts = _teacher_prompts(teacher_prompt_ids, teacher_prompt_attention_mask,
                                               batch.batch_size, 1)
            loss, num_tokens = self._distill(batch, teacher_prompts)
        return StepResult(loss, num_tokens, (time.perf_counter() - start) * 1e3, None, None, None, batch)

    # ---- the step, phase by phase -------------------------------------------------------------
    def _distill(self, batch: RolloutBatch, teacher_prompts) -> tuple[float, int]:
        """Teacher cache, student forward, loss, backward, optimizer step: ``(loss, num_positions)``."""
        num_kept, loss_mask, num_positions = self._loss_mask(batch)  # loss_mask: [N, k] over the kept logits
        weight = self._rank_weight(num_positions, loss_mask.device)
        caches = self._teacher_caches(batch, teacher_prompts, num_kept, loss_mask)
        with stage(stages.STUDENT_FORWARD):
            student_logits = self._forward(self.student, self._student_keeps, batch.input_ids,
                                           batch.attention_mask, num_kept)  # [N, k, V_s]
        with stage(stages.LOSS):
            values, ids = _gather_caches(caches, student_logits.device)
            loss = generalized_jsd_loss(student_logits, values, loss_mask.to(student_logits.device),
                                        self.config.beta, self.config.temperature,
                                        chunk_size=self.config.loss_chunk_size, teacher_top_k_ids=ids)
            del values, ids
            for cache in caches:
                cache.free()
            loss_value = loss.detach()
        with stage(stages.BACKWARD):
            self.student.backward(loss if weight == 1.0 else loss * weight)
        del loss, student_logits
        with stage(stages.OPTIMIZER_STEP):
            self.student.step()
        return float(loss_value), num_positions

    def _loss_mask(self, batch: RolloutBatch) -> tuple[int, torch.Tensor, int]:
        """``(k, mask [N, k], mask.sum())``: kept logits per row, which of them predict a response token."""
        seq_len = batch.seq_len
        start_col = int(batch.response_start_idx.min())
        full = response_logit_positions(batch.attention_mask, batch.response_start_idx, full_length=True)
        num_kept = seq_len - start_col + 1
        loss_mask = full[:, seq_len - num_kept:]  # [N, k]; column j predicts token start_col + j
        num_positions, max_id = torch.stack([loss_mask.sum(), batch.input_ids.max()]).tolist()
        _require(num_positions > 0, "mask", "the batch has no response position to distil on "
                 "(every response token is masked out)")
        _require(max_id < self.teacher_vocab_size, "teacher vocab_size",
                 f"{self.teacher_vocab_size} does not contain token id {max_id} of the batch; the teacher "
                 "cannot score the student's tokens")
        return num_kept, loss_mask, int(num_positions)

    def _teacher_caches(self, batch, teacher_prompts, num_kept: int, loss_mask) -> list[TeacherLogitCache]:
        """Teacher logits at the response positions, cached ``max_teacher_rows`` rows at a time."""
        ids, mask = batch.input_ids, batch.attention_mask
        if teacher_prompts is not None:
            start_col = int(batch.response_start_idx.min())
            _require(start_col == int(batch.response_start_idx.max()), "response_start_idx",
                     "must be equal in every row to replace the teacher's prompt")
            ids = torch.cat([teacher_prompts[0].to(ids.device), ids[:, start_col:]], dim=1)  # [N, T_t + T_r]
            mask = torch.cat([teacher_prompts[1].to(mask.device), mask[:, start_col:]], dim=1)
        rows_per_forward = self.config.max_teacher_rows or ids.shape[0]
        caches = []
        for row in range(0, ids.shape[0], rows_per_forward):
            rows = slice(row, row + rows_per_forward)
            with stage(stages.TEACHER_FORWARD), torch.no_grad(), self._teacher_mode():
                logits = self._forward(self.teacher, self._teacher_keeps, ids[rows], mask[rows], num_kept)
            with stage(stages.LOGIT_CACHE):
                caches.append(TeacherLogitCache.build(logits, loss_mask[rows].to(logits.device),
                                                      self.config.cache_config(),
                                                      student_vocab_size=self.student_vocab_size,
                                                      chunk_size=self.config.loss_chunk_size))
            del logits
        return caches

    def _teacher_mode(self):
        module = self.teacher if isinstance(self.teacher, torch.nn.Module) else getattr(self.teacher, "module", None)
        return _eval_mode(module) if isinstance(module, torch.nn.Module) else contextlib.nullcontext()

    @staticmethod
    def _forward(model, keeps: bool, ids: torch.Tensor, mask: torch.Tensor, num_kept: int) -> torch.Tensor:
        """Logits ``[n, k, V]`` of the last ``k`` positions (``logits_to_keep`` where supported)."""
        positions = masks.prompt_positions(mask)  # [n, T]: real-token count - 1, as in the rollout
        extra = {"logits_to_keep": num_kept} if keeps else {}
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False, **extra).logits
        return logits if logits.shape[1] == num_kept else logits[:, -num_kept:]

    def _rank_weight(self, num_positions: int, device: torch.device) -> float:
        """``n_rank * world / n_total`` over the data-parallel group (1.0 on a single rank)."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            return 1.0
        group = getattr(self.student, "data_parallel_group", None)
        world = dist.get_world_size(group)
        if world <= 1:
            return 1.0
        device = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
        total = torch.tensor([num_positions], dtype=torch.float64, device=device)
        dist.all_reduce(total, group=group)
        return num_positions * world / float(total.item())


def _gather_caches(caches: list[TeacherLogitCache], device) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Packed ``[N, V|K]`` teacher values (and top-k ids) of all row chunks, on ``device``."""
    parts = [cache.to_device(device) for cache in caches]
    if len(parts) == 1:
        return parts[0].values, parts[0].ids
    values = torch.cat([p.values for p in parts])  # row-major order is kept: chunks are row ranges
    ids = None if parts[0].ids is None else torch.cat([p.ids for p in parts])
    return values, ids


def _teacher_prompts(ids, mask, num_rows: int, num_samples: int):
    """``(ids, mask)`` ``[B*n, T_t]`` of the teacher's prompts, or None when none are given."""
    if ids is None and mask is None:
        return None
    _require(ids is not None and mask is not None, "teacher_prompt_ids",
             "teacher_prompt_ids and teacher_prompt_attention_mask go together")
    try:
        teacher = RolloutRequest(ids, mask)
    except ValueError as exc:
        raise ValueError(f"teacher_{exc}") from None
    _require(teacher.batch_size == num_rows, "teacher_prompt_ids",
             f"needs {num_rows} rows (one per prompt or rollout row); got {teacher.batch_size}")
    return expand_prompts(ids, mask, num_samples)


def _check_teacher_tokens(tokenizer, teacher_tokenizer, teacher_config) -> None:
    """ValueError when the teacher's EOS/pad ids or token->id map differ from the student's."""
    student_eos, student_pad = token_ids(tokenizer)
    if teacher_tokenizer is not None:
        eos, pad = token_ids(teacher_tokenizer)
        teacher_eos, source = set(eos), "teacher_tokenizer"
    else:
        teacher_eos, pad = _config_token_ids(teacher_config)
        source = "teacher config"
    if teacher_eos is not None and not set(student_eos) <= teacher_eos:
        raise ValueError(f"{source} eos_token_id: {sorted(teacher_eos)} does not contain the student "
                         f"tokenizer's EOS ids {sorted(student_eos)}; the teacher cannot be aligned")
    if pad is not None and pad != student_pad:
        raise ValueError(f"{source} pad_token_id: {pad} differs from the student tokenizer's {student_pad}")
    if teacher_tokenizer is not None:
        _check_vocab_map(tokenizer, teacher_tokenizer)


def _check_vocab_map(tokenizer, teacher_tokenizer) -> None:
    """Every token both tokenizers know must have the same id (skipped without ``get_vocab``)."""
    if not all(callable(getattr(tok, "get_vocab", None)) for tok in (tokenizer, teacher_tokenizer)):
        return
    teacher_vocab = teacher_tokenizer.get_vocab()
    for token, token_id in tokenizer.get_vocab().items():
        other = teacher_vocab.get(token)
        if other is not None and other != token_id:
            raise ValueError(f"teacher_tokenizer vocabulary: token {token!r} has id {token_id} for the "
                             f"student but {other} for the teacher; the logits cannot be aligned")

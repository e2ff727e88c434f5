"""The OPSD training step: rollout -> teacher forward + logit cache -> student forward -> loss -> update.

``OPSDStep.step(prompt_ids, prompt_attention_mask, sampling)`` runs one on-policy distillation step
on a student (a DeepSpeed engine, ZeRO-0..3, optionally a peft LoRA model inside; or a plain module
with a torch optimizer) against a teacher (a plain HF model, a peft model, a DeepSpeed engine, or
the student itself for self-distillation). Each phase runs inside its ``opsd/<stage>`` range.

Alignment. The logits at position ``t`` predict token ``t + 1``. Only the last ``k = T - s + 1``
positions are computed (``logits_to_keep=k``, ``s`` the first response column): position ``s - 1``
predicts the first response token; the last kept position predicts nothing and is masked out. The
loss mask is :func:`rollout.opsd.losses.response_logit_positions` restricted to those ``k`` columns.
Position ids count real tokens (``cumsum(mask) - 1``), as in the rollout's own forwards.

Memory. No ``[B, T, V]`` logits exist: teacher and student logits are ``[B, k, V]`` in the model
dtype. Teacher logits are computed ``max_teacher_rows`` rows at a time, cached at the response
positions only (bf16 by default, on the device or in pinned host memory) and freed right away; the
cache is freed right after the loss, before backward. The loss itself is chunked (see
:mod:`rollout.opsd.losses`).

Self-distillation. Pass the student (engine or module) as ``teacher``. The teacher forward then runs
on the current weights under ``no_grad`` with the module in eval mode (each submodule's flag restored
afterwards), so it is a constant target of this step. On identical inputs teacher and student agree
and the loss is 0: pass ``teacher_prompt_ids`` (e.g. a prompt with privileged context) so that the
teacher scores the same response under a different prompt; the response is aligned by its columns.

Vocabularies. Teacher and student may differ in vocabulary size: only the shared ids
``[0, min(V_s, V_t))`` are compared (:func:`rollout.opsd.losses.align_vocab`). A teacher whose EOS/pad ids
differ from the student tokenizer's, whose tokenizer maps a shared token to another id, or whose
vocabulary does not contain every id of the batch raises ``ValueError`` naming it.

Data parallel. Each rank distils its own rollout. With more than one data-parallel rank the loss
handed to backward is scaled by ``n_rank * world / n_total`` (one all-reduce of the token count), so
DeepSpeed's gradient averaging yields the mean over all response positions of all ranks.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from typing import Optional

import torch

from instrumentation import stage, stages
from rollout.checks import require
from rollout.config import RolloutConfig, SamplingConfig
from rollout.engine import Rollout
from rollout.model import compat
from rollout.ops import masks
from rollout.opsd.config import OPSDConfig, StepResult
from rollout.opsd.logit_cache import TeacherLogitCache
from rollout.opsd.losses import generalized_jsd_loss, response_logit_positions
from rollout.opsd.teacher import check_teacher_tokens, expanded_teacher_prompts, gather_caches
from rollout.request import RolloutBatch, RolloutRequest


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
        require(isinstance(self.config, OPSDConfig), "config",
                 f"must be an OPSDConfig; got {type(config).__name__}")
        if _is_training_engine(student):
            require(optimizer is None, "optimizer", "must be None for a DeepSpeed engine (it owns its optimizer)")
            self.student = student
        else:
            require(isinstance(student, torch.nn.Module), "student", "must be a DeepSpeed engine or a torch module")
            require(isinstance(optimizer, torch.optim.Optimizer), "optimizer",
                     f"a plain student module needs a torch optimizer; got {type(optimizer).__name__}")
            self.student = _PlainStudent(student, optimizer)
        self.student_module = compat.unwrap_model(student)
        require(teacher is not None, "teacher", "is required (pass the student for self-distillation)")
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
        require(top_k is None or top_k <= shared_vocab, "teacher_top_k",
                 f"{top_k} exceeds the shared vocabulary size {shared_vocab}")
        check_teacher_tokens(tokenizer, teacher_tokenizer, teacher_model.config)

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
            teacher_prompts = expanded_teacher_prompts(teacher_prompt_ids, teacher_prompt_attention_mask,
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
        require(isinstance(batch, RolloutBatch), "batch", f"must be a RolloutBatch; got {type(batch).__name__}")
        start = time.perf_counter()
        with stage(stages.STEP):
            teacher_prompts = expanded_teacher_prompts(teacher_prompt_ids, teacher_prompt_attention_mask,
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
            values, ids = gather_caches(caches, student_logits.device)
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
        require(num_positions > 0, "mask", "the batch has no response position to distil on "
                 "(every response token is masked out)")
        require(max_id < self.teacher_vocab_size, "teacher vocab_size",
                 f"{self.teacher_vocab_size} does not contain token id {max_id} of the batch; the teacher "
                 "cannot score the student's tokens")
        return num_kept, loss_mask, int(num_positions)

    def _teacher_caches(self, batch, teacher_prompts, num_kept: int, loss_mask) -> list[TeacherLogitCache]:
        """Teacher logits at the response positions, cached ``max_teacher_rows`` rows at a time."""
        ids, mask = batch.input_ids, batch.attention_mask
        if teacher_prompts is not None:
            start_col = int(batch.response_start_idx.min())
            require(start_col == int(batch.response_start_idx.max()), "response_start_idx",
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
        return compat.eval_mode(module) if isinstance(module, torch.nn.Module) else contextlib.nullcontext()

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



"""The OPSD training step: rollout -> teacher forward + logit cache -> student forward -> loss -> update.

``OPSDStep.step(prompt_ids, prompt_attention_mask, sampling)`` runs one on-policy distillation step
on a student (a DeepSpeed engine, ZeRO-0..3, optionally a peft LoRA model inside; or a plain module
with a torch optimizer) against a teacher (a plain HF model, a peft model, a DeepSpeed engine, or
the student itself for self-distillation). Each phase runs inside its ``opsd/<stage>`` range and is
timed (:class:`rollout.opsd.breakdown.StepBreakdown` in the result).

Micro-batches. After the rollout the rows are cut into student micro-batches
(:mod:`rollout.opsd.micro_batches`; ``OPSDConfig.max_student_rows``, by default as many rows as fit
a memory budget). For each micro-batch, in turn: the teacher forward over its rows (under
``no_grad``), their logits cached at the response positions only (bf16 or top-k, on the device or in
pinned host memory) and the teacher logits freed; the student forward; the loss, after which the
cache and the student logits are freed; backward. Gradients accumulate over the micro-batches
(:mod:`rollout.opsd.student`) and the optimizer steps once. Each micro-batch's loss is its summed
divergence over the batch's response-position count, so the micro-batches' losses and gradients add
up to those of the whole batch at once: the mean over all response positions. No ``[B, T, V]``
logits exist: logits are ``[rows, k, V]`` for one micro-batch's rows (``k``: the positions from the
last prompt token through its longest response), and the loss is chunked (:mod:`rollout.opsd.losses`).
Alignment of logits and tokens: :mod:`rollout.opsd.inputs`. That is the ``"padded"`` training path; the
``"packed"`` one (``OPSDConfig.train_path``, taken by ``"auto"`` where supported) packs each micro-batch's rows into
one sequence with variable-length attention, caches the teacher's final hidden states instead of its logits and
applies both heads inside a fused loss (:mod:`rollout.opsd.packed`, :mod:`rollout.opsd.fused_loss`); its
micro-batches are sized by real tokens.

Self-distillation. Pass the student (engine or module) as ``teacher``. The teacher forward then runs
on the current weights under ``no_grad`` with the module in eval mode (each submodule's flag restored
afterwards), so it is a constant target of this step (the weights change only at the optimizer step,
after every micro-batch). On identical inputs teacher and student agree and the loss is 0: pass
``teacher_prompt_ids`` (e.g. a prompt with privileged context) so that the teacher scores the same
response under a different prompt; the response is aligned by its columns.

Vocabularies. Teacher and student may differ in vocabulary size: only the shared ids
``[0, min(V_s, V_t))`` are compared (:func:`rollout.opsd.losses.align_vocab`). A teacher whose EOS/pad ids
differ from the student tokenizer's, whose tokenizer maps a shared token to another id, or whose
vocabulary does not contain every id of the batch raises ``ValueError`` naming it.

Data parallel. Each rank distils its own rollout. With more than one data-parallel rank one
all-gather of a few counts (:mod:`rollout.opsd.ranks`) lets every rank raise the same errors, run as
many micro-batches and teacher forwards as the others, and scale the loss handed to backward by
``n_rank * world / n_total``, so DeepSpeed's gradient averaging yields the mean over all response
positions of all ranks.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from dataclasses import dataclass, replace
from typing import Optional

import torch

from instrumentation import stage, stages
from instrumentation.worklog import recorder as work_recorder
from rollout.checks import require
from rollout.config import RolloutConfig, SamplingConfig
from rollout.engine import Rollout
from rollout.model import compat, zero
from rollout.model.lora import TrainingAdapters
from rollout.opsd import fast_passes, packed, sizing
from rollout.opsd.breakdown import PhaseTimer, rollout_path
from rollout.opsd.config import OPSDConfig, StepResult
from rollout.opsd.inputs import DistillInputs, distill_inputs, forward_logits
from rollout.opsd.fused_loss import fused_jsd_loss
from rollout.opsd.logit_cache import TeacherLogitCache
from rollout.opsd.losses import generalized_jsd_loss
from rollout.opsd.micro_batches import AUTO, MicroBatchPlan, Span, agree, plan_micro_batches
from rollout.opsd.ranks import EMPTY_FIGURES, REFUSED_FIGURES, RankFigures, check_figures, gather_figures, rank_weight
from rollout.opsd.student import EngineStudent, PlainStudent, is_training_engine
from rollout.opsd.teacher import TeacherStream, check_teacher_tokens, expanded_teacher_prompts
from rollout.request import RolloutBatch, RolloutRequest


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
        # ``student``: what was passed (engine) or its plain adapter; ``_trainer``: the interface the step drives.
        if is_training_engine(student):
            require(optimizer is None, "optimizer", "must be None for a DeepSpeed engine (it owns its optimizer)")
            self.student, self._trainer = student, EngineStudent(student)
        else:
            require(isinstance(student, torch.nn.Module), "student", "must be a DeepSpeed engine or a torch module")
            require(isinstance(optimizer, torch.optim.Optimizer), "optimizer",
                     f"a plain student module needs a torch optimizer; got {type(optimizer).__name__}")
            self.student = self._trainer = PlainStudent(student, optimizer)
        self.student_module = compat.unwrap_model(student)
        self._gather_target = student if is_training_engine(student) else self.student_module  # the engine: its
        # ZeRO-3 hooks are suspended while gathered
        require(teacher is not None, "teacher", "is required (pass the student for self-distillation)")
        self.is_self_distillation = teacher is student or compat.unwrap_model(teacher) is self.student_module
        # A training engine's forward does training bookkeeping: call its module (ZeRO-3 hooks live there).
        self.teacher = compat.unwrap_model(teacher) if is_training_engine(teacher) else teacher
        self.rollout = Rollout(student, tokenizer, rollout_config)
        student_model = compat.causal_lm(self.student_module)
        teacher_model = compat.causal_lm(getattr(self.teacher, "module", self.teacher))
        self.student_vocab_size = student_model.config.vocab_size
        self.teacher_vocab_size = teacher_model.config.vocab_size
        self._teacher_keeps = "logits_to_keep" in inspect.signature(type(teacher_model).forward).parameters
        self._student_keeps = "logits_to_keep" in inspect.signature(type(student_model).forward).parameters
        shared_vocab = min(self.student_vocab_size, self.teacher_vocab_size)
        top_k = self.config.teacher_top_k
        require(top_k is None or top_k <= shared_vocab, "teacher_top_k",
                 f"{top_k} exceeds the shared vocabulary size {shared_vocab}")
        check_teacher_tokens(tokenizer, teacher_tokenizer, teacher_model.config)
        self._student_model, self._teacher_model = student_model, teacher_model
        self.train_path, self.train_path_reason = self._choose_path(student_model, teacher_model)
        # A ZeRO-3 student whose rollout gathers its weights once (RolloutConfig.gather) is gathered once for the
        # packed passes as well, so that they run through the pieces instead of per-module gathers.
        self._gathers_student = self.rollout.is_zero3 and self.rollout.config.gather == "once"
        self.coalesces_gradients = False
        """Whether the step's micro-batches' gradients are reduced once (``OPSDConfig.coalesce_gradients``): set for
        each step, True where the student was gathered once for its passes and its engine can coalesce."""
        self.teacher_path = "padded"
        self.student_path, self.student_path_reason, _ = self._student_path()
        if self.train_path == "packed":
            device = next(teacher_model.parameters()).device
            fast = self.config.fast_teacher and fast_passes.fast_parts(teacher_model, device) is not None
            self.teacher_path = "fast" if fast else "hf"
            self.row_cost = sizing.packed_row_cost(student_model, teacher_model, self.config.loss_chunk_size)
        else:
            self.row_cost = sizing.row_cost(student_model, teacher_model, self.config.cache_config(),
                                            self.config.loss_chunk_size)

    def _choose_path(self, student_model, teacher_model) -> tuple[str, Optional[str]]:
        """``(path, why not packed)`` for ``OPSDConfig.train_path`` (ValueError when packed cannot run)."""
        setting = self.config.train_path
        if setting == "padded":
            return "padded", "train_path='padded'"
        reason = None
        if self.config.teacher_top_k is not None:
            reason = "a top-k teacher cache"
        for role, model in (("student", student_model), ("teacher", teacher_model)):
            why = packed.unsupported_reason(model)
            reason = reason or (None if why is None else f"{role}: {why}")
        require(setting != "packed" or reason is None, "train_path", f"'packed' cannot run here: {reason}")
        return ("padded", reason) if reason else ("packed", None)

    def _student_path(self) -> tuple[str, Optional[str], Optional[TrainingAdapters]]:
        """``(path, why not fast, adapters)`` of the student's pass: ``"fast"`` (:mod:`rollout.opsd.fast_passes`),
        ``"hf"`` (HF's packed forward) or ``"padded"``, and on the fast path a LoRA student's adapters for
        :func:`rollout.opsd.fast_passes.student_parts`; read at every step (activation checkpointing may be
        switched)."""
        if self.train_path != "packed":
            return "padded", self.train_path_reason, None
        if not self.config.fast_student:
            return "hf", "fast_student=False", None
        why, adapters = fast_passes.student_check(self._student_model, gathered=self._gathers_student)
        return ("hf", why, None) if why else ("fast", None, adapters)

    # ---- public -----------------------------------------------------------------------------
    def step(self, prompt_ids: torch.Tensor, prompt_attention_mask: torch.Tensor, sampling: SamplingConfig, *,
             teacher_prompt_ids: Optional[torch.Tensor] = None,
             teacher_prompt_attention_mask: Optional[torch.Tensor] = None,
             row_max_new_tokens: Optional[torch.Tensor] = None) -> StepResult:
        """Rollout on ``[B, T_p]`` left-padded prompts, then distil on it (one optimizer step).

        ``teacher_prompt_*`` (``[B, T_t]``, left-padded, one per prompt) replace the prompts in the
        teacher's input; the response is the rollout's. ``row_max_new_tokens`` (``[B*n]``): each response's own
        budget (``RolloutRequest.row_max_new_tokens``).
        """
        require(isinstance(sampling, SamplingConfig), "sampling",
                f"must be a SamplingConfig; got {type(sampling).__name__}")
        start, timer = time.perf_counter(), PhaseTimer()
        with stage(stages.STEP):
            request = RolloutRequest(prompt_ids, prompt_attention_mask, row_max_new_tokens=row_max_new_tokens)
            teacher_prompts = expanded_teacher_prompts(teacher_prompt_ids, teacher_prompt_attention_mask,
                                                       request.batch_size, sampling.n_samples_per_prompt)
            with timer.phase(stages.ROLLOUT, opens_range=False):  # the rollout opens its own range
                batch = self.rollout.generate(request, sampling)
                num_tokens = int(batch.attention_mask[:, request.prompt_len:].sum())  # a sync: the rollout is done
            rollout_s = time.perf_counter() - start
            work_recorder().rollout(self._student_model, request.prompt_attention_mask, batch.attention_mask,
                                    sampling.n_samples_per_prompt)  # off: no-op
            loss, _, breakdown = self._distill(batch, teacher_prompts, timer, rollout_path(self.rollout.last_stats))
        return StepResult(loss, num_tokens, (time.perf_counter() - start) * 1e3, rollout_s * 1e3,
                          num_tokens / rollout_s if rollout_s > 0 else 0.0, self.rollout.get_last_profile(), batch,
                          breakdown)

    def train_on_batch(self, batch: RolloutBatch, *, teacher_prompt_ids: Optional[torch.Tensor] = None,
                       teacher_prompt_attention_mask: Optional[torch.Tensor] = None) -> StepResult:
        """Distil on a given rollout (e.g. from another engine): everything of :meth:`step` but the
        rollout. ``teacher_prompt_*`` are ``[N, T_t]``, one per rollout row."""
        require(isinstance(batch, RolloutBatch), "batch", f"must be a RolloutBatch; got {type(batch).__name__}")
        start = time.perf_counter()
        with stage(stages.STEP):
            try:
                teacher_prompts, refusal = expanded_teacher_prompts(teacher_prompt_ids, teacher_prompt_attention_mask,
                                                                    batch.batch_size, 1), None
            except ValueError as exc:  # raised after the step's collectives, which the other ranks wait in
                teacher_prompts, refusal = None, exc
            loss, num_tokens, breakdown = self._distill(batch, teacher_prompts, PhaseTimer(), refusal=refusal)
        return StepResult(loss, num_tokens, (time.perf_counter() - start) * 1e3, None, None, None, batch, breakdown)

    # ---- the step, phase by phase -------------------------------------------------------------
    def _distill(self, batch: RolloutBatch, teacher_prompts, timer: PhaseTimer, rollout: str = "",
                 refusal: Optional[ValueError] = None):
        """Plan, then teacher + student per micro-batch, then the optimizer: ``(loss, positions, breakdown)``.
        ``refusal``: this rank's inputs were refused before the step; it is raised after the collectives (raising here
        would leave the other data-parallel ranks waiting in them), and every other rank raises too."""
        inputs = None  # None: refused below, on every rank
        if refusal is None and batch.batch_size:
            try:
                inputs = distill_inputs(batch, teacher_prompts)
            except ValueError as exc:
                refusal = exc
        config = self.config
        self.student_path, self.student_path_reason, adapters = self._student_path()
        with contextlib.ExitStack() as weights:
            if self.student_path == "fast" and self._gathers_student:  # before the budget: the copy takes memory
                with timer.phase(stages.STUDENT_FORWARD), stage(stages.GATHER):  # booked to the student's passes
                    weights.enter_context(zero.gathered(self._gather_target, "once"))
            if inputs is None:  # the others' collectives, then the error every rank raises (not this rank's alone)
                figures = gather_figures(EMPTY_FIGURES if refusal is None else REFUSED_FIGURES,
                                         self._trainer.data_parallel_group, batch.input_ids.device)
                if refusal is not None:
                    raise refusal
                check_figures(figures, self.teacher_vocab_size)
            budget = sizing.budget_bytes(config.max_micro_batch_gib, inputs.ids.device, self.train_path == "packed") \
                if config.max_student_rows == AUTO else None
            plan = plan_micro_batches(inputs.stats, config.max_student_rows, config.max_teacher_rows, self.row_cost,
                                      budget or 0.0)
            local = RankFigures(inputs.num_positions, len(plan.groups), len(plan.teacher_chunks), plan.num_rows,
                                inputs.max_token_id, inputs.min_token_id)
            figures = gather_figures(local, self._trainer.data_parallel_group, inputs.ids.device)
            check_figures(figures, self.teacher_vocab_size)
            plan = agree(plan, max(f.num_micro_batches for f in figures), max(f.num_teacher_forwards for f in figures))
            loss = self._train(inputs, plan, rank_weight(figures, local), timer, (adapters, weights.close))
        work_recorder().training(self._student_model, self._teacher_model, inputs.stats, plan.order, config,
                                 self.train_path == "packed")  # off: no-op
        largest = max(stop - start for start, stop in plan.groups)
        is_packed = self.train_path == "packed"
        tokens = max(inputs.stats.tokens(plan.rows(span), is_packed) for span in plan.groups)
        return loss, inputs.num_positions, timer.breakdown(len(plan.groups), largest, len(plan.teacher_chunks),
                                                           budget, train_path=self.train_path,
                                                           teacher_path=self.teacher_path,
                                                           student_path=self.student_path, max_tokens=tokens,
                                                           rollout=rollout)

    def _train(self, inputs: DistillInputs, plan: MicroBatchPlan, weight: float, timer: PhaseTimer,
               student_pass: tuple) -> float:
        """Every micro-batch (teacher chunks built just before they are read), then one optimizer step.
        ``student_pass``: the fast student's adapters (:meth:`_student_path`) and what releases its gathered weights
        (a no-op unless ZeRO-3 weights were gathered for the passes)."""
        # The teacher's pieces: views of its weights, which change only at the optimizer step after every chunk.
        device = inputs.ids.device
        adapters, release = student_pass
        parts = fast_passes.fast_parts(self._teacher_model, device) if self.teacher_path == "fast" else None
        student = fast_passes.student_parts(self._student_model, device, adapters) \
            if self.student_path == "fast" else None
        run = _Run(inputs, plan, torch.tensor(plan.order, device=device), weight, timer, parts, student)
        stream = TeacherStream(lambda span: self._teacher_chunk(run, span), plan.teacher_chunks,
                               [inputs.stats.num_positions[row] for row in plan.order])
        total = torch.zeros((), dtype=torch.float32, device=inputs.ids.device)
        self.coalesces_gradients = (self.config.coalesce_gradients and student is not None and self._gathers_student
                                    and self._trainer.can_coalesce)
        reduction = contextlib.ExitStack()  # closing it reduces the coalesced gradients (a no-op otherwise)
        try:
            if self.coalesces_gradients:
                reduction.enter_context(self._trainer.coalesced())
            for index, span in enumerate(plan.groups):
                stream.prepare(span)
                total += self._micro_batch(run, span, stream, is_last=index == len(plan.groups) - 1)
        except BaseException:
            try:
                reduction.close()
            finally:
                self._trainer.discard_gradients()  # a later step must not apply this one's partial gradients
            raise
        finally:
            stream.close()
        with timer.phase(stages.OPTIMIZER_STEP):
            reduction.close()  # coalesced: the micro-batches' gradients reduced into ZeRO-3's partitions, once
            release()  # gathered ZeRO-3 weights are partitioned again first (ZeRO-3's step partitions every one)
            self._trainer.step()
        return float(total)  # the step's one sync after the rollout's

    def _teacher_chunk(self, run: "_Run", span: Span) -> TeacherLogitCache:
        """One teacher forward over ``span``'s rows, cached at their response positions."""
        if self.train_path == "packed":
            return self._packed_teacher_chunk(run, span)
        inputs, index = run.inputs, run.order[span[0]:span[1]]
        first, stop, kept = inputs.stats.columns(run.plan.rows(span), teacher=True)
        with run.timer.phase(stages.TEACHER_FORWARD), torch.no_grad(), self._teacher_mode():
            logits = forward_logits(self.teacher, self._teacher_keeps, inputs.teacher_ids[index, first:stop],
                                    inputs.teacher_mask[index, first:stop], kept)  # [n, kept, V_t]
        with run.timer.phase(stages.LOGIT_CACHE):
            return TeacherLogitCache.build(logits, inputs.loss_mask[index, :kept].to(logits.device),
                                           self.config.cache_config(), student_vocab_size=self.student_vocab_size,
                                           chunk_size=self.config.loss_chunk_size)

    def _packed_teacher_chunk(self, run: "_Run", span: Span) -> TeacherLogitCache:
        """The packed path's teacher forward: final hidden states at the loss positions, cached."""
        inputs, index = run.inputs, run.order[span[0]:span[1]]
        with run.timer.phase(stages.TEACHER_FORWARD), torch.no_grad(), self._teacher_mode():
            rows = packed.pack(inputs.teacher_ids[index], inputs.teacher_mask[index], inputs.loss_mask[index])
            if run.teacher_parts is not None:
                hidden = fast_passes.fast_loss_hidden(run.teacher_parts, rows)  # [N, H_t]
            else:
                with packed.packed_attention(self._teacher_model, rows.layout):
                    hidden = packed.loss_hidden(self.teacher, self._teacher_model, rows)
        with run.timer.phase(stages.LOGIT_CACHE):  # kept in the teacher's own dtype (no logits are rounded)
            return TeacherLogitCache.from_rows(hidden, replace(self.config.cache_config(), dtype=hidden.dtype))

    def _packed_micro_batch(self, run: "_Run", span: Span, stream: TeacherStream, is_last: bool) -> torch.Tensor:
        """The packed path's student forward, fused head + loss and backward (the packed attention is held
        through backward: checkpointed layers recompute there)."""
        inputs, index, config = run.inputs, run.order[span[0]:span[1]], self.config
        model = self._student_model
        with contextlib.ExitStack() as held:
            with run.timer.phase(stages.STUDENT_FORWARD):
                self._trainer.begin_micro_batch(is_last)
                rows = packed.pack(inputs.ids[index], inputs.mask[index], inputs.loss_mask[index])
                held.enter_context(packed.packed_attention(model, rows.layout))
                with (fast_passes.student_decoder(model, run.student_parts, rows) if run.student_parts is not None
                      else contextlib.nullcontext()):
                    hidden = packed.loss_hidden(self._trainer, model, rows)  # [N, H]
            with run.timer.phase(stages.LOSS):
                values, _ = stream.take(span, hidden.device)
                teacher_head = packed.head_weight(self._teacher_model)
                shared = teacher_head is packed.head_weight(model)  # self-distillation: one (maybe partitioned) head

                def loss_of(head, hidden_in, teacher_in):  # the student's head as its module's forward (ZeRO-3
                    return fused_jsd_loss(hidden_in, head, teacher_in, head if shared else teacher_head,  # gathers it)
                                          config.beta, config.temperature, chunk_size=config.loss_chunk_size,
                                          divisor=inputs.num_positions)

                with contextlib.nullcontext() if shared else zero.gathered(self._teacher_model.lm_head, "once"):
                    loss = packed.through_head(model, loss_of, hidden, values)
                del values, hidden
                stream.release(span)
            with run.timer.phase(stages.BACKWARD):
                self._trainer.backward(loss if run.weight == 1.0 else loss * run.weight)
        return loss.detach()

    def _micro_batch(self, run: "_Run", span: Span, stream: TeacherStream, is_last: bool) -> torch.Tensor:
        """Student forward, loss and backward of ``span``'s rows; returns the (detached) loss share."""
        if self.train_path == "packed":
            return self._packed_micro_batch(run, span, stream, is_last)
        inputs, index, config = run.inputs, run.order[span[0]:span[1]], self.config
        first, stop, kept = inputs.stats.columns(run.plan.rows(span))
        with run.timer.phase(stages.STUDENT_FORWARD):
            self._trainer.begin_micro_batch(is_last)
            logits = forward_logits(self._trainer, self._student_keeps, inputs.ids[index, first:stop],
                                    inputs.mask[index, first:stop], kept)  # [n, kept, V_s]
        with run.timer.phase(stages.LOSS):
            values, top_ids = stream.take(span, logits.device)
            loss = generalized_jsd_loss(logits, values, inputs.loss_mask[index, :kept].to(logits.device),
                                        config.beta, config.temperature, chunk_size=config.loss_chunk_size,
                                        teacher_top_k_ids=top_ids, num_positions_total=inputs.num_positions)
            del values, top_ids, logits  # the loss keeps only its gradient buffer
            stream.release(span)
        with run.timer.phase(stages.BACKWARD):
            self._trainer.backward(loss if run.weight == 1.0 else loss * run.weight)
        return loss.detach()

    def _teacher_mode(self):
        module = self.teacher if isinstance(self.teacher, torch.nn.Module) else getattr(self.teacher, "module", None)
        return compat.eval_mode(module) if isinstance(module, torch.nn.Module) else contextlib.nullcontext()


@dataclass(frozen=True)
class _Run:
    """What every micro-batch of one step reads."""

    inputs: DistillInputs
    plan: MicroBatchPlan
    order: torch.Tensor
    """``plan.order`` on the device (row indices)."""
    weight: float
    """The data-parallel loss weight (:func:`rollout.opsd.ranks.rank_weight`)."""
    timer: PhaseTimer
    teacher_parts: object = None
    """The fast teacher's decoder pieces (:func:`rollout.opsd.fast_passes.fast_parts`), built once a step; None
    otherwise."""
    student_parts: object = None
    """The fast student's pieces (:func:`rollout.opsd.fast_passes.student_parts`), built once a step; None
    otherwise."""

"""Work records: what each stage of an OPSD step had to compute and move (pure, no torch).

One :class:`StageWork` per (step, stage): rows, real tokens, FLOPs and bytes, from the model geometry and the
realised row lengths, with the formulas of :mod:`instrumentation.roofline` (those of ``benchmarks.step``).
N: the loss positions, V = min(V_s, V_t): the shared vocabulary, H_s / H_t: the hidden sizes, e_s / e_t: the
weights' element bytes, e_c: the cache's.

* ``prefill``: :func:`~instrumentation.roofline.prefill_flops` over the unique prompts (each once, not once per
  sample); rows: the prompts, tokens: their real tokens; bytes: every weight once;
* ``decode``: the sums over decode steps of :func:`~instrumentation.roofline.decode_steps` (weights + the live
  rows' KV context read per step; 2 * params FLOPs per live row + attention over its context; a row lives until
  its realised length); rows: the rollout's rows, tokens: the tokens the steps produced (L_r - 1 a row). Its
  roofline is a sum over steps of max(bytes_t / copy, flops_t / GEMM), not one max over the sums: ``roofline_s``
  carries it exactly when the rates are known;
* ``teacher_forward``: :func:`~instrumentation.roofline.forward_flops` over the teacher's rows (prompt + response
  real tokens); bytes: every teacher weight once;
* ``logit_cache``: no FLOPs; bytes: the teacher's logits at the loss positions read (N * V * e_t) and the cache
  written (N * width * e_c, width V or top-k K, + N * K * 4 for top-k ids); the packed path caches the final
  hidden states instead: N * H_t * e_t read and written;
* ``student_forward``: as the teacher's, over the student's rows; bytes: every weight once;
* ``loss``: the padded path: no matmul FLOPs; bytes: the cache read + the student's logits at the loss positions
  read and their gradient written (2 * N * V * e_s). The packed path (fused loss): the head GEMMs,
  2 * N * V * (H_s + H_t) (both heads' logits) + 2 * N * V * H_s (the hidden states' gradient) + 2 * N * V * H_s
  (the head's gradient, when the head trains); bytes: both heads once (V * (H_s * e_s + H_t * e_t)), the cache
  read, the student's hidden states read and their gradient written (2 * N * H_s * e_s), the float32 head gradient
  written (4 * V * H_s, when the head trains);
* ``backward``: :func:`~instrumentation.roofline.backward_flops` (2x the student forward's FLOPs when every weight
  trains; a frozen base with LoRA adapters: the inputs' gradients, about 1x); bytes: every weight read, and the
  gradients of the trained share written;
* ``optimizer_step``: no matmul FLOPs; bytes: :func:`~instrumentation.roofline.optimizer_bytes`.

Each head GEMM is charged to the stage whose range runs it, once: on the padded path the teacher's head (at the
loss positions) to ``teacher_forward``, the student's to ``student_forward`` and its gradients to ``backward``; on
the packed path all of them to ``loss`` (the fused loss computes the logits and pushes their gradient through the
heads there; backward only scales it), and the passes count no head. FLOPs count matmuls only (dense layers,
attention's score and value products over the causal triangle, the heads); bytes count weights, the optimizer's
state, the cache and the loss's inputs, not other activations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from instrumentation import stages as S
from instrumentation.roofline import (ModelGeometry, Rates, backward_flops, decode_steps, forward_flops, optimizer_bytes,
                                     pass_bytes,
                                      prefill_flops, work_roofline_s)

#: Stages that get work records.
WORK_STAGES = (S.PREFILL, S.DECODE, S.TEACHER_FORWARD, S.LOGIT_CACHE, S.STUDENT_FORWARD, S.LOSS, S.BACKWARD,
               S.OPTIMIZER_STEP)


@dataclass(frozen=True)
class StageWork:
    """The work of one stage in one step."""

    stage: str
    """A stage of :mod:`instrumentation.stages` (bare, e.g. ``"backward"``)."""
    rows: int
    """Sequences it processed (0 for the optimizer)."""
    tokens: int
    """Real tokens it processed, padding excluded (loss positions for ``loss`` and ``logit_cache``; 0 for the
    optimizer)."""
    flops: float
    """Matmul FLOPs it had to compute."""
    bytes: float
    """Bytes it had to move (weights, optimizer state, cache, the loss's inputs)."""
    roofline_s: Optional[float] = None
    """Its least time at the run's rates where that is not max(bytes / copy, flops / GEMM) of the totals (decode:
    a sum over its steps); None: the totals' max."""

    def __post_init__(self) -> None:
        if self.stage not in S.ALL_STAGES:
            raise ValueError(f"stage: unknown stage {self.stage!r}")
        for name in ("rows", "tokens", "flops", "bytes", "roofline_s"):
            value = getattr(self, name)
            if name == "roofline_s" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0:
                raise ValueError(f"{name}: must be a finite number >= 0; got {value!r}")


@dataclass(frozen=True)
class Head:
    """A model's output head, as the loss and the cache see it."""

    vocab: int
    hidden: int
    element_bytes: int
    """Bytes of one weight element (the model's dtype)."""
    trainable: bool = False
    """Whether the head's weight takes a gradient."""


def rollout_work(prompt_lens: Sequence[int], samples_per_prompt: int, response_lens: Sequence[int],
                 geo: ModelGeometry, rates: Optional[Rates] = None) -> tuple[StageWork, StageWork]:
    """``(prefill, decode)`` of a rollout (see the module docstring): row i (real prompt tokens ``prompt_lens[i]``,
    realised response length ``response_lens[i]``) is sample i % n of prompt i // n; ``rates``: the decode's exact
    ``roofline_s`` (None: not known)."""
    unique = list(prompt_lens[::samples_per_prompt])
    prefill = StageWork(S.PREFILL, len(unique), sum(unique), prefill_flops(unique, geo), geo.weight_bytes)
    flops = num_bytes = roofline_s = 0.0
    tokens = 0
    for step_bytes, step_flops, live in decode_steps(prompt_lens, response_lens, geo):
        flops, num_bytes, tokens = flops + step_flops, num_bytes + step_bytes, tokens + live
        if rates is not None:
            roofline_s += work_roofline_s(step_flops, step_bytes, rates)
    decode = StageWork(S.DECODE, len(response_lens), tokens, flops, num_bytes,
                       roofline_s if rates is not None else None)
    return prefill, decode


def training_work(student_rows: Sequence[int], teacher_rows: Sequence[int], loss_positions: int,
                  student: ModelGeometry, teacher: ModelGeometry, trainable_params: int,
                  packed: bool = False, trained_share: float = 1.0) -> tuple[StageWork, ...]:
    """The passes' and the optimizer's :class:`StageWork` (see the module docstring) of rows of ``student_rows`` /
    ``teacher_rows`` real tokens; the heads at ``loss_positions`` positions (``packed``: in the loss, not here);
    ``trained_share``: of the student's matmul weights (:func:`instrumentation.geometry.trained_share`)."""
    rows, head_positions = len(student_rows), 0 if packed else loss_positions
    student_flops = forward_flops(student_rows, student, head_positions)
    return (StageWork(S.TEACHER_FORWARD, len(teacher_rows), sum(teacher_rows),
                      forward_flops(teacher_rows, teacher, head_positions), pass_bytes(teacher)),
            StageWork(S.STUDENT_FORWARD, rows, sum(student_rows), student_flops, pass_bytes(student)),
            StageWork(S.BACKWARD, rows, sum(student_rows), backward_flops(student_rows, student, head_positions,
                                                                          trained_share),
                      pass_bytes(student, 1 + trained_share)),
            StageWork(S.OPTIMIZER_STEP, 0, 0, 0.0, optimizer_bytes(trainable_params)))


def cache_bytes(positions: int, student: Head, teacher: Head, packed: bool, element_bytes: int,
                top_k: Optional[int] = None) -> int:
    """Bytes of the teacher cache of ``positions`` loss positions: hidden states (``packed``; the teacher's dtype),
    else logits over the shared vocabulary or the top-k values (``element_bytes`` each) and their int32 ids."""
    if packed:
        return positions * teacher.hidden * teacher.element_bytes
    if top_k is not None:
        return positions * top_k * (element_bytes + 4)
    return positions * min(student.vocab, teacher.vocab) * element_bytes


def distill_work(rows: int, positions: int, student: Head, teacher: Head, packed: bool,
                 stored_bytes: int) -> tuple[StageWork, StageWork]:
    """``(logit_cache, loss)`` of ``rows`` rows with ``positions`` loss positions and a cache of ``stored_bytes``
    (:func:`cache_bytes`); see the module docstring."""
    n, vocab = positions, min(student.vocab, teacher.vocab)
    if packed:
        cache = StageWork(S.LOGIT_CACHE, rows, n, 0.0, 2 * stored_bytes)
        gradient_gemms = 2 if student.trainable else 1
        flops = 2 * n * vocab * (student.hidden + teacher.hidden) + gradient_gemms * 2 * n * vocab * student.hidden
        num_bytes = vocab * (student.hidden * student.element_bytes + teacher.hidden * teacher.element_bytes) \
            + stored_bytes + 2 * n * student.hidden * student.element_bytes \
            + (4 * vocab * student.hidden if student.trainable else 0)
        return cache, StageWork(S.LOSS, rows, n, float(flops), num_bytes)
    cache = StageWork(S.LOGIT_CACHE, rows, n, 0.0, n * vocab * teacher.element_bytes + stored_bytes)
    return cache, StageWork(S.LOSS, rows, n, 0.0, stored_bytes + 2 * n * vocab * student.element_bytes)

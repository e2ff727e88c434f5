"""Work records: what each training phase of an OPSD step had to compute and move (pure, no torch).

One :class:`StageWork` per (step, stage): rows, real tokens, FLOPs and bytes, from the model geometry and the
realised row lengths, with the formulas of :mod:`instrumentation.roofline` (those of ``benchmarks.step``):

* ``teacher_forward``: :func:`~instrumentation.roofline.forward_flops` over the teacher's rows (prompt +
  response real tokens), the head at the loss positions; bytes: every teacher weight once;
* ``student_forward``: the same over the student's rows (its head at the loss positions: the padded path
  computes it here, the packed path inside ``loss``; either way it is charged here); bytes: every weight once;
* ``backward``: 2x the student forward's FLOPs; bytes: every weight twice (read, gradient written);
* ``optimizer_step``: no matmul FLOPs; bytes: :func:`~instrumentation.roofline.optimizer_bytes`.

FLOPs count matmuls only (dense layers, attention's score and value products over the causal triangle, the
head); bytes count weights (and the optimizer's state), not activations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from instrumentation import stages as S
from instrumentation.roofline import ModelGeometry, forward_flops, optimizer_bytes, pass_bytes

#: Stages that get work records.
WORK_STAGES = (S.TEACHER_FORWARD, S.STUDENT_FORWARD, S.BACKWARD, S.OPTIMIZER_STEP)


@dataclass(frozen=True)
class StageWork:
    """The work of one stage in one step."""

    stage: str
    """A stage of :mod:`instrumentation.stages` (bare, e.g. ``"backward"``)."""
    rows: int
    """Sequences it processed (0 for the optimizer)."""
    tokens: int
    """Real tokens it processed, padding excluded (0 for the optimizer)."""
    flops: float
    """Matmul FLOPs it had to compute."""
    bytes: float
    """Bytes it had to move (weights, optimizer state)."""

    def __post_init__(self) -> None:
        if self.stage not in S.ALL_STAGES:
            raise ValueError(f"stage: unknown stage {self.stage!r}")
        for name in ("rows", "tokens", "flops", "bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0:
                raise ValueError(f"{name}: must be a finite number >= 0; got {value!r}")


def training_work(student_rows: Sequence[int], teacher_rows: Sequence[int], loss_positions: int,
                  student: ModelGeometry, teacher: ModelGeometry, trainable_params: int) -> tuple[StageWork, ...]:
    """The training phases' :class:`StageWork` (see the module docstring) of rows of ``student_rows`` /
    ``teacher_rows`` real tokens, with the heads applied at ``loss_positions`` positions."""
    rows = len(student_rows)
    student_flops = forward_flops(student_rows, student, loss_positions)
    return (StageWork(S.TEACHER_FORWARD, len(teacher_rows), sum(teacher_rows),
                      forward_flops(teacher_rows, teacher, loss_positions), pass_bytes(teacher)),
            StageWork(S.STUDENT_FORWARD, rows, sum(student_rows), student_flops, pass_bytes(student)),
            StageWork(S.BACKWARD, rows, sum(student_rows), 2 * student_flops, pass_bytes(student, 2)),
            StageWork(S.OPTIMIZER_STEP, 0, 0, 0.0, optimizer_bytes(trainable_params)))

"""The work sidecar of a run: ``<run_dir>/rank{R}.work.jsonl``, one JSON line per (step, stage) (no torch).

The OPSD step hands its phases' work to :func:`recorder` at the end of its training part; a profiler session
(``opsd_profiler``, modes ``1`` and ``timers``, on the selected ranks) opens a :class:`WorkLog` with its run
directory and, for each timed step, points the recorder at it. A line::

    {"step": 1, "rank": 0, "stage": "backward", "rows": 16, "tokens": 1536, "flops": 2.1e9, "bytes": 1.8e6,
     "peak_flops_s": 9.894e14, "copy_bytes_s": 4.8e12}

(the rates :mod:`instrumentation.rates` resolved, null when unknown). Off (``OPSD_PROFILE`` unset, ``0`` or
``nvtx``) :func:`recorder` is one shared do-nothing object, picked when the config is set; on, the recorder
returns at once while no step is timed. Failures give one ``ProfilingWarning`` and training goes on.
"""

from __future__ import annotations

import json
import os
from typing import Optional

from instrumentation import state
from instrumentation.geometry import model_geometry, trainable_params
from instrumentation.work import StageWork, training_work

WORK_SUFFIX = ".work.jsonl"


def work_path(run_dir: str, rank: int) -> str:
    """``<run_dir>/rank{R}.work.jsonl``."""
    return os.path.join(run_dir, f"rank{rank}{WORK_SUFFIX}")


class WorkLog:
    """Appends a rank's work lines to its sidecar, with the rates to divide by."""

    def __init__(self, path: str, rank: int, peak_flops_s: Optional[float], copy_bytes_s: Optional[float]):
        self.path, self.rank = path, rank
        self.rates = {"peak_flops_s": peak_flops_s, "copy_bytes_s": copy_bytes_s}

    def write(self, step: int, works: list) -> None:
        lines = [json.dumps({"step": step, "rank": self.rank, "stage": w.stage, "rows": w.rows, "tokens": w.tokens,
                             "flops": w.flops, "bytes": w.bytes, **self.rates}) + "\n" for w in works]
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.writelines(lines)
        except OSError as exc:
            state.warn_once("work-log", f"could not write the work sidecar {self.path}: {exc!r}")


class _NoWork:
    """The off path: every call does nothing."""

    __slots__ = ()

    def training(self, student_model, teacher_model, stats, order) -> None:
        return None


class WorkRecorder:
    """Collects the work of the timed step (see the module docstring)."""

    def __init__(self):
        self.log: Optional[WorkLog] = None
        self.step = 0
        self.works: list[StageWork] = []

    def begin(self, log: Optional[WorkLog], step: int) -> None:
        self.log, self.step, self.works = log, step, []

    def end(self) -> None:
        log, works, self.log, self.works = self.log, self.works, None, []
        if log is not None and works:
            log.write(self.step, _summed(works))

    def training(self, student_model, teacher_model, stats, order) -> None:
        """The training phases of one step: ``stats`` (``RowStats``) of the batch, ``order`` its processed rows."""
        if self.log is None:
            return
        try:  # the geometry is read again each recorded step (no reference to the models is kept)
            self.works += training_work(*_row_tokens(stats, order), sum(stats.num_positions[r] for r in order),
                                        model_geometry(student_model), model_geometry(teacher_model),
                                        trainable_params(student_model))
        except Exception as exc:  # noqa: BLE001 - profiling never breaks training
            state.warn_once("work", f"opsd work records disabled for a step: {exc!r}")


def _row_tokens(stats, order) -> tuple[list, list]:
    """Real tokens per processed row: the student's input, the teacher's (its own prompt + the response)."""
    student = [stats.num_tokens[r] for r in order]
    shift = lambda r: (stats.teacher_response_column - stats.teacher_first_column[r]) \
        - (stats.response_column - stats.first_column[r])
    return student, [n + shift(r) for n, r in zip(student, order)]


def _summed(works: list) -> list:
    """One record per stage (a step that records the same stage twice adds them up)."""
    out: dict[str, StageWork] = {}
    for w in works:
        old = out.get(w.stage)
        out[w.stage] = w if old is None else StageWork(w.stage, old.rows + w.rows, old.tokens + w.tokens,
                                                      old.flops + w.flops, old.bytes + w.bytes)
    return list(out.values())


NO_WORK = _NoWork()
#: The process-wide recorder of the on path.
RECORDER = WorkRecorder()
_active = NO_WORK


def recorder():
    """The active recorder: :data:`NO_WORK` with profiling off or ``nvtx``, else :data:`RECORDER`."""
    return _active


def _install(config) -> None:
    global _active
    _active = RECORDER if config.stage_timers else NO_WORK


state.on_configure(_install, lambda: RECORDER.begin(None, 0))

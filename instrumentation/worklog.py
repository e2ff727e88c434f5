"""The work sidecar of a run: ``<run_dir>/rank{R}.work.jsonl``, one JSON line per (step, stage) (no torch).

The OPSD step hands the rollout's work to :func:`recorder` after the rollout (prompt and realised response
lengths: ``prefill``, ``decode``) and its training's at the end of its training part (``teacher_forward``,
``logit_cache``, ``student_forward``, ``loss``, ``backward``, ``optimizer_step``; formulas in
:mod:`instrumentation.work`); a profiler session (``opsd_profiler``, modes ``1`` and ``timers``, on the selected
ranks) opens a :class:`WorkLog` with its run directory and, for each timed step, points the recorder at it. A line::

    {"step": 1, "rank": 0, "stage": "decode", "rows": 16, "tokens": 1008, "flops": 2.1e9, "bytes": 1.8e8,
     "peak_flops_s": 7.5e14, "copy_bytes_s": 4.2e12, "roofline_s": 4.4e-5,
     "peak_flops_source": "measured", "copy_bytes_source": "env"}

The rates are those :func:`instrumentation.rates.resolve_rates` gave (null when unknown) and where each came from
(``env``, ``measured``, ``datasheet``, null). ``roofline_s``, written when both rates are known, is the stage's
exact least time: the sum over its records of their own (decode's: a sum over its steps), else
max(bytes / copy bytes/s, flops / peak FLOP/s). Off (``OPSD_PROFILE`` unset, ``0`` or
``nvtx``) :func:`recorder` is one shared do-nothing object, picked when the config is set; on, the recorder
returns at once while no step is timed. Failures give one ``ProfilingWarning`` and training goes on.
"""

from __future__ import annotations

import json
import os
import weakref
from typing import Optional

from instrumentation import state
from instrumentation.geometry import head, model_geometry, trainable_params, trained_share
from instrumentation.rates import DeviceRates
from instrumentation.roofline import Rates, work_roofline_s
from instrumentation.work import WORK_STAGES, StageWork, cache_bytes, distill_work, rollout_work, training_work

WORK_SUFFIX = ".work.jsonl"


def work_path(run_dir: str, rank: int) -> str:
    """``<run_dir>/rank{R}.work.jsonl``."""
    return os.path.join(run_dir, f"rank{rank}{WORK_SUFFIX}")


class WorkLog:
    """Appends a rank's work lines to its sidecar, with the rates to divide by."""

    def __init__(self, path: str, rank: int, rates: DeviceRates):
        self.path, self.rank = path, rank
        self.fields = {"peak_flops_s": rates.peak_flops_s, "copy_bytes_s": rates.copy_bytes_s}
        self.sources = {"peak_flops_source": rates.peak_flops_source, "copy_bytes_source": rates.copy_bytes_source}
        known = rates.peak_flops_s is not None and rates.copy_bytes_s is not None
        self.rates: Optional[Rates] = Rates(rates.copy_bytes_s, rates.peak_flops_s) if known else None
        """Both rates, None unless both are known."""

    def write(self, step: int, works: list) -> list:
        """Append step ``step``'s records (one per stage, see :func:`_summed`) and return them."""
        summed = _summed(works, self.rates)
        lines = [json.dumps({"step": step, "rank": self.rank, "stage": w.stage, "rows": w.rows, "tokens": w.tokens,
                             "flops": w.flops, "bytes": w.bytes, **self.fields,
                             **({} if w.roofline_s is None else {"roofline_s": w.roofline_s}), **self.sources}) + "\n"
                 for w in summed]
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.writelines(lines)
        except OSError as exc:
            state.warn_once("work-log", f"could not write the work sidecar {self.path}: {exc!r}")
        return summed


class _NoWork:
    """The off path: every call does nothing."""

    __slots__ = ()

    def rollout(self, model, prompt_mask, attention_mask, samples_per_prompt) -> None:
        return None

    def training(self, student_model, teacher_model, stats, order, config=None, packed=False) -> None:
        return None


class WorkRecorder:
    """Collects the work of the timed step (see the module docstring)."""

    def __init__(self):
        self.log: Optional[WorkLog] = None
        self.step = 0
        self.works: list[StageWork] = []

    def begin(self, log: Optional[WorkLog], step: int) -> None:
        self.log, self.step, self.works = log, step, []

    def end(self) -> list:
        """Write the timed step's records; return them (one per stage, with the exact ``roofline_s`` when the
        rates are known) for its timers-mode scalars; ``[]`` when nothing was recorded."""
        log, works, self.log, self.works = self.log, self.works, None, []
        if log is None or not works:
            return []
        try:
            return log.write(self.step, works)
        except Exception as exc:  # noqa: BLE001 - profiling never breaks training
            state.warn_once("work", f"opsd work records disabled for a step: {exc!r}")
            return []

    def rollout(self, model, prompt_mask, attention_mask, samples_per_prompt: int) -> None:
        """The rollout of one step: ``prompt_mask`` ``[B, T_p]`` of the prompts, ``attention_mask`` ``[B*n, T_p + T_r]``
        of the rollout's rows (row i: sample i % n of prompt i // n); one host read of their lengths."""
        if self.log is None:
            return
        try:
            prompt_lens = [int(n) for n in (prompt_mask != 0).sum(dim=1).tolist()]
            response_lens = [int(n) for n in (attention_mask[:, prompt_mask.shape[1]:] != 0).sum(dim=1).tolist()]
            rows = [prompt_lens[i // samples_per_prompt] for i in range(len(response_lens))]
            self.works += rollout_work(rows, samples_per_prompt, response_lens, _geometry(model), self.log.rates)
        except Exception as exc:  # noqa: BLE001 - profiling never breaks training
            state.warn_once("work", f"opsd work records disabled for a step: {exc!r}")

    def training(self, student_model, teacher_model, stats, order, config=None, packed: bool = False) -> None:
        """The training phases of one step: ``stats`` (``RowStats``) of the batch, ``order`` its processed rows,
        ``config`` the step's ``OPSDConfig`` (its cache; None: no cache or loss records), ``packed``: the packed
        path's (heads in the loss)."""
        if self.log is None:
            return
        try:  # geometry and trainable count are read on a model's first recorded step (no reference is kept)
            positions = sum(stats.num_positions[r] for r in order)
            self.works += training_work(*_row_tokens(stats, order), positions, _geometry(student_model),
                                        _geometry(teacher_model), _once(_TRAINABLE, student_model, trainable_params),
                                        packed, _once(_SHARE, student_model, trained_share))
            if config is not None:
                student, teacher, cache = head(student_model), head(teacher_model), config.cache_config()
                stored = cache_bytes(positions, student, teacher, packed, cache.dtype.itemsize, cache.top_k)
                self.works += distill_work(len(order), positions, student, teacher, packed, stored)
        except Exception as exc:  # noqa: BLE001 - profiling never breaks training
            state.warn_once("work", f"opsd work records disabled for a step: {exc!r}")


_GEOMETRY: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
"""Each model's geometry, read once (its shape does not change while it trains); no reference to a model is kept."""
_SHARE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
"""Each student's share of trained matmul weights, read once (as its trainable count)."""
_TRAINABLE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
"""Each student's trainable parameter count, read once (a parameter frozen or unfrozen after its first recorded
step is not seen by the optimizer's record)."""


def _once(table, model, read):
    """``read(model)``, kept in ``table`` for the model's later steps (a pass over a 3B model's 434 parameter
    tensors costs ~0.5 ms of host time; every step paid several)."""
    try:
        return table[model]
    except (KeyError, TypeError):
        value = read(model)
        try:
            table[model] = value
        except TypeError:  # not weak-referenceable: read every step
            pass
        return value


def _geometry(model):
    """``model_geometry(model)``, read on the first recorded step of ``model`` only."""
    return _once(_GEOMETRY, model, model_geometry)


def _row_tokens(stats, order) -> tuple[list, list]:
    """Real tokens per processed row: the student's input, the teacher's (its own prompt + the response)."""
    student = [stats.num_tokens[r] for r in order]
    shift = lambda r: (stats.teacher_response_column - stats.teacher_first_column[r]) \
        - (stats.response_column - stats.first_column[r])
    return student, [n + shift(r) for n, r in zip(student, order)]


def _summed(works: list, rates: Optional[Rates]) -> list:
    """One record per stage (a step that records the same stage twice adds them up), with its exact
    ``roofline_s`` when ``rates`` are known (the sum of its records' own, or of their max(bytes, flops) terms)."""
    out: dict[str, StageWork] = {}
    for w in works:
        own = w.roofline_s if w.roofline_s is not None or rates is None else work_roofline_s(w.flops, w.bytes, rates)
        old = out.get(w.stage)
        out[w.stage] = StageWork(w.stage, w.rows, w.tokens, w.flops, w.bytes, own) if old is None else \
            StageWork(w.stage, old.rows + w.rows, old.tokens + w.tokens, old.flops + w.flops, old.bytes + w.bytes,
                      None if own is None or old.roofline_s is None else old.roofline_s + own)
    order = {stage: i for i, stage in enumerate(WORK_STAGES)}
    return sorted(out.values(), key=lambda w: order.get(w.stage, len(order)))  # the step's order


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

"""A profiler session's step figures: what each timed step leaves for its scalars, and writing them (no torch).

The session calls :meth:`StepLog.begin` when a timed step starts (the allocator's peak reset, CUDA only),
:meth:`StepLog.end` when it ends (its peaks, FLOPs and top-level stages kept until its device times are
resolved) and :meth:`StepLog.write` once they are (stage scalars, the step's figures, and with the first step
the custom-scalars layout and the hparams). Tags and definitions: :mod:`instrumentation.stepscalars`.
"""

from __future__ import annotations

from typing import Optional

from instrumentation import rates, state, stepscalars
from instrumentation.backends import STEP_PEAKS
from instrumentation.scalars import ScalarWriter


class StepLog:
    """See the module docstring; one per profiler session."""

    def __init__(self, scalars: ScalarWriter, session_hparams: Optional[dict] = None,
                 peak_rates: tuple = (None, None)):
        self.scalars = scalars
        self.rates = peak_rates
        """``(peak FLOP/s, copy bytes/s)`` of :func:`instrumentation.rates.device_rates`."""
        self.hparams = {k: stepscalars.hparam_value(v) for k, v in (session_hparams or {}).items()}
        self.wrote_layout = False
        self._facts: dict[int, stepscalars.StepFacts] = {}

    @classmethod
    def of_session(cls, scalars: ScalarWriter, config, rank: int, world_size: int, environ) -> "StepLog":
        flops_s, bytes_s = rates.device_rates(environ, rates.device_name())
        return cls(scalars, {"profile_mode": config.mode, "profile_every": config.every,
                             "profile_steps": ",".join(map(str, config.steps)), "rank": rank,
                             "world_size": world_size, "device": rates.device_name(),
                             "peak_tflops": flops_s / 1e12 if flops_s else None,
                             "peak_tbps": bytes_s / 1e12 if bytes_s else None}, (flops_s, bytes_s))

    def add_hparams(self, values: dict) -> None:
        if self.wrote_layout:
            state.warn_once("hparams", "prof.log_hparams after the first timed step: not written")
        self.hparams.update({name: stepscalars.hparam_value(v) for name, v in values.items()})

    def begin(self, backend) -> None:
        """Reset the allocator's peaks for the step (CUDA; host-side, no device sync)."""
        if backend.tracks_memory:
            try:
                STEP_PEAKS.begin(backend)
            except Exception as exc:  # noqa: BLE001 - profiling never breaks training
                state.warn_once("step-peaks", f"opsd step peak memory disabled: {exc!r}")

    def end(self, step: int, records: list, flops: Optional[float], backend, works=()) -> None:
        """Keep what step ``step``'s scalars need (its peaks are read now; ``records``: its ``StageRecord``;
        ``works``: its ``StageWork``, one per stage, from :mod:`instrumentation.worklog`)."""
        peaks = (None, None)
        if STEP_PEAKS.active:
            try:
                peaks = STEP_PEAKS.end(backend)
            except Exception as exc:  # noqa: BLE001
                STEP_PEAKS.active = False
                state.warn_once("step-peaks", f"opsd step peak memory disabled: {exc!r}")
        if records:
            self._facts[step] = stepscalars.StepFacts(stepscalars.top_level_stages(records), flops, *peaks,
                                                      works=list(works))

    def write(self, step: int, summary: dict, wall_ms: float, warmup: bool, has_clock: bool, flush: bool) -> None:
        """Step ``step``'s scalars, once its device times are resolved (``summary``: ``collect.summarize``)."""
        facts = self._facts.pop(step, None) or stepscalars.StepFacts()
        if not self.wrote_layout:
            self.wrote_layout = True
            self.scalars.layout_and_hparams(stepscalars.layout(facts.top_level), self.hparams,
                                            stepscalars.HPARAM_METRICS)
        self.scalars.stages(step, summary, has_clock, flush=False, prefix=stepscalars.WARMUP_PREFIX if warmup else "")
        figures = stepscalars.step_figures(summary, wall_ms, facts, has_clock, self.rates[0])
        rooflines = stepscalars.x_roofline(summary, facts.works, *self.rates) if has_clock else {}
        self.scalars.values(step, stepscalars.step_tags(figures, rooflines, warmup))
        if flush:
            self.scalars.flush()

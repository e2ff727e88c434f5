"""A timed step's own figures for TensorBoard: MFU, GPU busy, peak memory, x roofline (pure, no torch).

Written by a profiler session (modes ``timers`` and ``1``) next to the per-stage scalars of
:mod:`instrumentation.scalars`, one value per timed step:

* ``opsd/step_mfu``: ``flops / (step s * peak FLOP/s)`` (:func:`instrumentation.mfu.mfu`): the model FLOPs the
  loop handed with ``prof.note_step_flops`` (:func:`instrumentation.mfu.opsd_step_flops`, the formula of
  ``train/mfu``), the step's host time (``opsd/step``'s, else the time between two ``prof.step()``), the peak of
  :func:`instrumentation.rates.device_rates` (``OPSD_PEAK_TFLOPS``, else the data sheet); absent without FLOPs or
  a peak;
* ``opsd/step_gpu_busy``: the CUDA-event time of the step's top-level stages (those directly inside
  ``opsd/step``, or outside any stage) over the step's host time, a fraction. An event pair measures the
  stream's span between two points, gaps between kernels included, so this is an upper bound of the trace
  report's GPU busy (kernel union); what it shows is the share of the step during which the GPU had a stage's
  work in front of it, and so the host time outside any stage. Above 1 where the host ran ahead of the device (a
  step with no host sync). Absent without a device clock (the CPU);
* ``opsd/step_peak_allocated_mib`` / ``opsd/step_peak_reserved_mib``: the caching allocator's peaks during the
  step (:data:`instrumentation.backends.STEP_PEAKS`: kept across the per-phase resets); CUDA only;
* ``opsd/<stage>/x_roofline``: the stage's GPU ms over its roofline ms, for the stages with a work record
  (:mod:`instrumentation.worklog`: prefill, decode, teacher and student passes, loss, logit cache, backward,
  optimizer; the same ``roofline_s`` as the work sidecar that ``summarize_trace.py`` reads, else ``max(flops /
  peak FLOP/s, bytes / copy bytes/s)``). Absent without a device clock or without both rates.

The warm-up step (the session's first timed step when it is step 0: captures, compilation, kernels built per
shape, as in the live table) has every ``opsd/`` tag under ``warmup/`` (``warmup/opsd/step_mfu``), so the
steady-state charts and the layout leave it out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping, Optional

from instrumentation import stages
from instrumentation.mfu import mfu
from instrumentation.roofline import Rates, work_roofline_s

STEP_PREFIX = stages.PREFIX + "step_"
#: Tag prefix of the warm-up step's scalars.
WARMUP_PREFIX = "warmup/"
BYTES_PER_MIB = 1024 * 1024


@dataclass
class StepFacts:
    """What a timed step leaves for its scalars, kept until its device times are resolved."""

    top_level: frozenset = frozenset()
    """Stages directly inside ``opsd/step`` or outside any stage (the step's phases)."""
    flops: Optional[float] = None
    """Model FLOPs of the step (``prof.note_step_flops``)."""
    peak_allocated_bytes: Optional[int] = None
    peak_reserved_bytes: Optional[int] = None
    works: list = field(default_factory=list)
    """The step's ``instrumentation.work.StageWork`` records, one per stage (empty: no x roofline scalars)."""


def top_level_stages(records) -> frozenset:
    """The stages of ``records`` (``StageRecord``) that are the step's phases (see :class:`StepFacts`)."""
    return frozenset(r.stage for r in records if r.stage != stages.STEP and r.parent in (None, stages.STEP))


def step_ms(summary: Mapping[str, dict], wall_ms: float) -> float:
    """The step's host time: ``opsd/step``'s when it was timed, else the time between two ``prof.step()``."""
    step = summary.get(stages.STEP)
    return step["host_ms"] if step is not None else wall_ms


def step_figures(summary: Mapping[str, dict], wall_ms: float, facts: StepFacts, has_device_clock: bool,
                 peak_flops_s: Optional[float]) -> dict[str, float]:
    """``{name: value}`` of the step's figures (see the module docstring; absent where unknown)."""
    ms, out = step_ms(summary, wall_ms), {}
    if facts.flops is not None:
        value = mfu(facts.flops, ms / 1e3, peak_flops_s)
        if value is not None:
            out["mfu"] = value
    if has_device_clock and ms > 0:
        out["gpu_busy"] = sum(summary[s]["device_ms"] for s in facts.top_level if s in summary) / ms
    if facts.peak_allocated_bytes is not None:
        out["peak_allocated_mib"] = facts.peak_allocated_bytes / BYTES_PER_MIB
    if facts.peak_reserved_bytes is not None:
        out["peak_reserved_mib"] = facts.peak_reserved_bytes / BYTES_PER_MIB
    return out


def x_roofline(summary: Mapping[str, dict], works, peak_flops_s: Optional[float],
               copy_bytes_s: Optional[float]) -> dict[str, float]:
    """``{stage: GPU ms / roofline ms}`` of the stages with work: a record's own exact ``roofline_s`` (the work
    sidecar's, at the run's rates; decode's is a sum over its steps), else ``max(flops / peak FLOP/s, bytes /
    copy bytes/s)`` (none without both rates)."""
    out = {}
    for work in works:
        if work.roofline_s is not None:
            roofline_ms = work.roofline_s * 1e3
        elif peak_flops_s and copy_bytes_s:
            roofline_ms = work_roofline_s(work.flops, work.bytes, Rates(copy_bytes_s, peak_flops_s)) * 1e3
        else:
            continue
        entry = summary.get(work.stage)
        if entry is not None and roofline_ms > 0:
            out[work.stage] = entry["device_ms"] / roofline_ms
    return out


def step_tags(figures: Mapping[str, float], rooflines: Mapping[str, float], warmup: bool) -> list[tuple]:
    """``(tag, value)`` pairs of :func:`step_figures` and :func:`x_roofline`."""
    prefix = WARMUP_PREFIX if warmup else ""
    tagged = [(prefix + STEP_PREFIX + name, value) for name, value in figures.items()]
    return tagged + [(prefix + stages.range_name(s) + "/x_roofline", v) for s, v in rooflines.items()]


def _alternatives(names) -> str:
    return "(" + "|".join(re.escape(n) for n in sorted(names)) + ")"


def layout(top_level) -> dict:
    """The custom-scalars layout (TensorBoard's ``custom_scalars`` plugin, "Custom Scalars" tab): per-stage
    charts of the step's phases with ``opsd/step`` as the total, and the step's figures. TensorBoard draws no
    stacked areas: a ``Multiline`` chart puts every phase on one chart, the step's line above them."""
    phases = _alternatives(list(top_level) + [stages.STEP])
    step = lambda *names: [STEP_PREFIX + n for n in names]
    return {"opsd step": {
        "GPU ms per phase (opsd/step = total)": ["Multiline", [f"^opsd/{phases}/gpu_ms$"]],
        "CPU ms per phase (opsd/step = total)": ["Multiline", [f"^opsd/{phases}/cpu_ms$"]],
        "MFU and GPU busy (fractions)": ["Multiline", step("mfu", "gpu_busy") + ["train/mfu"]],
        "peak memory MiB": ["Multiline", step("peak_allocated_mib", "peak_reserved_mib")],
        "x roofline per phase": ["Multiline", [r"^opsd/[^/]+/x_roofline$"]],
    }}


#: Metrics the hparams table shows per run (TensorBoard's HParams tab), by tag.
HPARAM_METRICS = (STEP_PREFIX + "mfu", STEP_PREFIX + "gpu_busy", STEP_PREFIX + "peak_allocated_mib",
                  "opsd/step/cpu_ms", "opsd/step/gpu_ms", "train/loss", "train/step_ms", "train/mfu")


def hparam_value(value):
    """A value TensorBoard's hparams accept (bool, int, float, str): others as text, None as ``"-"``."""
    if isinstance(value, (bool, int, float, str)):
        return value
    return "-" if value is None else str(value)

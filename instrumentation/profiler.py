"""``opsd_profiler()``: a torchtitan-style profiler session for training loops.

    with opsd_profiler() as prof:
        for step in range(num_steps):
            with stage(stages.STEP):
                ...
            prof.step()

With ``OPSD_PROFILE=1``, on the selected ranks, the session

* runs ``torch.profiler`` over the recorded steps (``OPSD_PROFILE_STEPS``; see
  :mod:`instrumentation.schedule`) and writes one trace per rank per window through
  ``tensorboard_trace_handler(run_dir, worker_name=f"rank{R}", use_gzip=True)``, i.e.
  ``<run_dir>/rank{R}.<time_ns>.pt.trace.json.gz``;
* times every stage of the recorded steps and writes TensorBoard scalars per recorded step
  (``opsd/<stage>/device_ms``, ``/host_ms``, ``/peak_mib``; per-step totals) under
  ``<run_dir>/rank{R}/``, and keeps a live per-stage table (:meth:`ProfilerSession.stage_rows`).

Off, in ``nvtx`` mode and on unselected ranks the session does nothing but count steps. Any failure
of the machinery (directory, trace handler, writer, profiler start) gives one warning per cause and
the loop goes on. Call ``prof.step()`` outside the ``opsd/step`` range.
"""

from __future__ import annotations

import glob
import os
import time
import warnings
from typing import Optional

import torch

from instrumentation import runfiles, schedule, stages, state
from instrumentation.collect import StageTable, format_stage_rows, summarize
from instrumentation.config import ProfileConfig
from instrumentation.timers import HUB

_ACTIONS = {
    schedule.NONE: torch.profiler.ProfilerAction.NONE,
    schedule.WARMUP: torch.profiler.ProfilerAction.WARMUP,
    schedule.RECORD: torch.profiler.ProfilerAction.RECORD,
    schedule.RECORD_AND_SAVE: torch.profiler.ProfilerAction.RECORD_AND_SAVE,
}


class _StepSink:
    """Receives the stage records of one recorded step; peaks may be reset."""

    allows_reset = True

    def __init__(self):
        self.records: list = []
        self.t0 = time.perf_counter()

    def add(self, record) -> None:
        self.records.append(record)


class ProfilerSession:
    """See the module docstring; build it with :func:`opsd_profiler`."""

    def __init__(self, config: Optional[ProfileConfig] = None, rank: Optional[int] = None,
                 world_size: Optional[int] = None):
        if config is not None and not isinstance(config, ProfileConfig):
            raise ValueError(f"config must be a ProfileConfig or None; got {type(config).__name__}")
        self._explicit_config = config
        self.rank, self.world_size = runfiles.resolve_rank(rank, world_size)
        self.config: Optional[ProfileConfig] = None
        self.run_dir: Optional[str] = None
        """``<output_dir>/<run_name>``; None when nothing is written on this rank."""
        self.scalars_dir: Optional[str] = None
        self.current_step = 0
        self.recorded_steps: list[int] = []
        self.selected = False
        """Whether this rank records (mode ``1`` and selected by ``OPSD_PROFILE_RANKS``)."""
        self._table = StageTable()
        self._sink: Optional[_StepSink] = None
        self._torch_prof = None
        self._writer = None
        self._previous_config: Optional[ProfileConfig] = None
        self._swapped_config = False

    # -- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> "ProfilerSession":
        active = state.get_config()
        config = self._explicit_config or active
        if config != active:  # the ranges must follow the session's config; restored on exit
            self._previous_config, self._swapped_config = state.configure(config), True
        self.config = config
        if not config.timing:
            return self
        HUB.num_sessions += 1
        run_name = runfiles.shared_run_name(config, self.world_size)
        self.selected = config.selects_rank(self.rank)
        if not self.selected:
            return self
        self.run_dir = runfiles.make_run_dir(os.path.join(config.output_dir, run_name))
        if self.run_dir is not None:
            self.scalars_dir = os.path.join(self.run_dir, f"rank{self.rank}")
            self._start_torch_profiler(config)
            if config.oom_snapshot:
                runfiles.record_memory_history(True)
        self._begin_step()
        return self

    def step(self) -> None:
        """Mark the end of the current training step (call it after every step)."""
        if not self.selected:
            self.current_step += 1
            return
        self._end_step()
        self.current_step += 1
        if self._torch_prof is not None:
            try:
                with warnings.catch_warnings():  # we export every cycle: torch's note does not apply
                    warnings.filterwarnings("ignore", message=".*Profiler clears events.*")
                    self._torch_prof.step()
            except Exception as exc:
                state.warn_once("trace-step", f"torch.profiler failed; traces stop here: {exc!r}")
                self._torch_prof = None
        self._begin_step()

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            if self.selected:
                if (exc_type is not None and issubclass(exc_type, torch.cuda.OutOfMemoryError)
                        and self.config.oom_snapshot and self._sink is not None and self.run_dir):
                    runfiles.dump_oom_snapshot(self.run_dir, self.rank)
                self._end_step()
                self._stop_torch_profiler()
                if self.config.oom_snapshot and self.run_dir is not None:
                    runfiles.record_memory_history(False)
                self._close_writer()
        finally:
            if self.config is not None and self.config.timing:
                HUB.num_sessions = max(0, HUB.num_sessions - 1)
            if self._swapped_config and self._previous_config is not None:
                state.configure(self._previous_config)
        return False

    # -- results ---------------------------------------------------------------------------
    def trace_paths(self) -> list[str]:
        """This rank's trace files written so far in this run (sorted by time)."""
        if self.run_dir is None:
            return []
        return sorted(glob.glob(os.path.join(self.run_dir, f"rank{self.rank}.*.pt.trace.json.gz")))

    def stage_rows(self) -> list[dict]:
        """Live per-stage table over the recorded steps (see ``StageTable.rows``)."""
        return self._table.rows()

    def stage_table(self, title: Optional[str] = None) -> str:
        """:meth:`stage_rows` as fixed-width text."""
        return format_stage_rows(self.stage_rows(), title)

    # -- steps -----------------------------------------------------------------------------
    def _begin_step(self) -> None:
        if self.config.records_step(self.current_step):
            self._sink = _StepSink()
            HUB.add_sink(self._sink)

    def _end_step(self) -> None:
        sink, self._sink = self._sink, None
        if sink is None:
            return
        HUB.remove_sink(sink)
        wall_ms = (time.perf_counter() - sink.t0) * 1e3
        if not sink.records:
            return
        try:
            summary = summarize(sink.records, HUB.backend)
        except Exception as exc:
            state.warn_once("summarize", f"opsd stage timers could not be resolved: {exc!r}")
            return
        self.recorded_steps.append(self.current_step)
        self._table.add_step(summary, wall_ms)
        self._write_scalars(summary)

    def _write_scalars(self, summary: dict) -> None:
        if self.scalars_dir is None:
            return
        try:
            if self._writer is None:
                from torch.utils.tensorboard import SummaryWriter

                self._writer = SummaryWriter(log_dir=self.scalars_dir)
            for name, entry in summary.items():
                prefix = stages.range_name(name) + "/"
                self._writer.add_scalar(prefix + "device_ms", entry["device_ms"], self.current_step)
                self._writer.add_scalar(prefix + "host_ms", entry["host_ms"], self.current_step)
                if entry["peak_allocated_mib"] is not None:
                    self._writer.add_scalar(prefix + "peak_mib", entry["peak_allocated_mib"],
                                            self.current_step)
            self._writer.flush()
        except Exception as exc:
            state.warn_once("scalars", f"opsd TensorBoard scalars disabled: {exc!r}")
            self.scalars_dir = None

    def _close_writer(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            try:
                writer.close()
            except Exception as exc:
                state.warn_once("scalars", f"opsd TensorBoard scalars disabled: {exc!r}")

    # -- torch.profiler --------------------------------------------------------------------
    def _start_torch_profiler(self, config: ProfileConfig) -> None:
        windows = schedule.WindowSchedule(config.steps)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        try:
            handler = torch.profiler.tensorboard_trace_handler(
                self.run_dir, worker_name=f"rank{self.rank}", use_gzip=True)
            prof = torch.profiler.profile(
                activities=activities, schedule=lambda step: _ACTIONS[windows(step)],
                on_trace_ready=_guarded(handler), profile_memory=config.profile_memory)
            prof.start()
        except Exception as exc:
            state.warn_once("trace-start", f"torch.profiler could not start; no traces: {exc!r}")
            return
        self._torch_prof = prof

    def _stop_torch_profiler(self) -> None:
        prof, self._torch_prof = self._torch_prof, None
        if prof is not None:
            try:
                prof.stop()  # saves a window cut short by the end of the loop
            except Exception as exc:
                state.warn_once("trace-stop", f"torch.profiler failed to stop cleanly: {exc!r}")

    # -- files -----------------------------------------------------------------------------


def _guarded(handler):
    """Wrap a trace handler so that a failure warns once instead of raising into the loop."""

    def on_trace_ready(prof) -> None:
        try:
            handler(prof)
        except Exception as exc:
            state.warn_once("trace-handler", f"opsd trace export failed; training goes on: {exc!r}")

    return on_trace_ready


def opsd_profiler(config: Optional[ProfileConfig] = None, rank: Optional[int] = None,
                  world_size: Optional[int] = None) -> ProfilerSession:
    """A :class:`ProfilerSession` for ``with opsd_profiler() as prof: ...; prof.step()``.

    ``config`` defaults to the process-wide active config; an explicit one becomes the active
    config for the duration of the session (so ``stage()`` ranges follow it).
    """
    return ProfilerSession(config, rank, world_size)

"""The torch.profiler side of a mode-``1`` session: trace windows, CUPTI teardown, OOM snapshots.

``TEARDOWN_CUPTI``: Kineto keeps CUPTI's callbacks installed after a trace window unless the
environment variable ``TEARDOWN_CUPTI=1`` is set (pytorch/pytorch#144455, pytorch/kineto#1264);
they can slow the unrecorded steps that follow. It is set before the profiler starts and again before
it stops, by default wherever torch's CUDA runtime is >= 12.6 (torch resets it to ``0`` below, where
CUDA graphs and CUPTI teardown do not mix); ``OPSD_PROFILE_TEARDOWN_CUPTI=0`` leaves torch's default.
On the H200 (CUDA 13) CUDA graphs captured before a window replay, and new ones capture and replay,
after windows with teardown. Whether the lingering cost is real there is not settled: in the one pair
of runs (docs/BENCHMARKS.md, 2026-12-01 evening) the steps after the window ran 27% slower than before
it without teardown, but the run with teardown had already drifted to the same ~550 ms before its
window. ``python -m benchmarks.profiler_cost linger`` measures it and checks the graphs.

Trace files are written by :func:`instrumentation.export.export_trace` (atomically, validated, all
temporary files inside the run directory).
"""

from __future__ import annotations

import os
import warnings
from typing import Optional

import torch

from instrumentation import export, runfiles, schedule, state
from instrumentation.config import ProfileConfig, teardown_by_default


def teardown_cupti(config: ProfileConfig) -> bool:
    """Whether this session tears CUPTI down after its trace windows: the config's switch, or where it
    is None (the default) torch's CUDA runtime >= 12.6."""
    if config.teardown_cupti is not None:
        return config.teardown_cupti
    return teardown_by_default(torch.version.cuda)


_ACTIONS = {
    schedule.NONE: torch.profiler.ProfilerAction.NONE,
    schedule.WARMUP: torch.profiler.ProfilerAction.WARMUP,
    schedule.RECORD: torch.profiler.ProfilerAction.RECORD,
    schedule.RECORD_AND_SAVE: torch.profiler.ProfilerAction.RECORD_AND_SAVE,
}


class TraceWindows:
    """A running torch.profiler over the recorded steps of one rank (build with :meth:`start`)."""

    def __init__(self, config: ProfileConfig, run_dir: str, rank: int, prof=None):
        self.config, self.run_dir, self.rank, self._prof = config, run_dir, rank, prof

    def on_trace_ready(self, prof) -> None:
        """torch.profiler's callback: export one window; a failure warns once, training goes on."""
        try:
            export.export_trace(prof, self.run_dir, self.rank)
        except Exception as exc:
            state.warn_once("trace-handler", f"opsd trace export failed, this window has no trace (no "
                                             f"file left under a trace name); training goes on: {exc!r}")

    @classmethod
    def start(cls, config: ProfileConfig, run_dir: str, rank: int) -> Optional["TraceWindows"]:
        """Start the profiler (and the allocator history for OOM snapshots); None when it fails."""
        windows = schedule.WindowSchedule(config.steps)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        traces = cls(config, run_dir, rank)
        try:
            prof = torch.profiler.profile(
                activities=activities, schedule=lambda step: _ACTIONS[windows(step)],
                on_trace_ready=traces.on_trace_ready, profile_memory=config.profile_memory)
            cls._teardown_env(config)
            prof.start()
        except Exception as exc:
            state.warn_once("trace-start", f"torch.profiler could not start; no traces: {exc!r}")
            return None
        traces._prof = prof
        if config.oom_snapshot:
            runfiles.record_memory_history(True)
        return traces

    @staticmethod
    def _teardown_env(config: ProfileConfig) -> None:
        if teardown_cupti(config):
            os.environ["TEARDOWN_CUPTI"] = "1"

    def step(self) -> None:
        if self._prof is None:
            return
        try:
            with warnings.catch_warnings():  # we export every cycle: torch's note does not apply
                warnings.filterwarnings("ignore", message=".*Profiler clears events.*")
                self._teardown_env(self.config)
                self._prof.step()
        except Exception as exc:
            state.warn_once("trace-step", f"torch.profiler failed; traces stop here: {exc!r}")
            self._prof = None

    def maybe_dump_oom(self, exc_type, in_recorded_step: bool) -> None:
        """On a CUDA OOM leaving a recorded step: write the memory snapshot (mode ``1`` option)."""
        if (exc_type is not None and issubclass(exc_type, torch.cuda.OutOfMemoryError)
                and self.config.oom_snapshot and in_recorded_step):
            runfiles.dump_oom_snapshot(self.run_dir, self.rank)

    def stop(self) -> None:
        prof, self._prof = self._prof, None
        if prof is not None:
            try:
                self._teardown_env(self.config)
                prof.stop()  # saves a window cut short by the end of the loop
            except Exception as exc:
                state.warn_once("trace-stop", f"torch.profiler failed to stop cleanly: {exc!r}")
        if self.config.oom_snapshot:
            runfiles.record_memory_history(False)

"""``opsd_profiler()``: a torchtitan-style profiler session for training loops.

    with opsd_profiler() as prof:
        for step in range(num_steps):
            with stage(stages.STEP):   # your own step; OPSDStep.step opens opsd/step itself: never wrap it
                ...
            prof.log_step(step, loss=loss, tokens_per_s=tps, step_ms=ms, mfu=mfu)  # optional
            prof.step()

One step index everywhere: ``prof.step()`` counts training steps from 0; ``OPSD_PROFILE_STEPS``, the TensorBoard
x axis (live and ``opsd-summarize --tensorboard``), ``ProfilerStep#N`` and ``opsd-summarize --by-step`` use it.

With ``OPSD_PROFILE=1``, on the selected ranks, the session

* runs ``torch.profiler`` over the recorded steps (``OPSD_PROFILE_STEPS``; :mod:`instrumentation.schedule`) and
  writes one trace per rank per window, ``<run_dir>/rank{R}.<time_ns>.pt.trace.json.gz``, atomically;
* times every stage of the recorded steps and writes TensorBoard scalars per recorded step under ``<run_dir>/rank{R}/``
  (tags in :mod:`instrumentation.scalars`), and keeps a live per-stage table (:meth:`ProfilerSession.stage_rows`);
* writes the work of each recorded step (FLOPs, bytes, rows, tokens per rollout and training stage, and the
  device's peak rates: the user's, else measured once per session on the GPU, else the data sheet's) to
  ``<run_dir>/rank{R}.work.jsonl`` (:mod:`instrumentation.worklog`), where ``opsd-summarize`` reads it.

With ``OPSD_PROFILE=timers`` (the always-on light mode) it times the stages of every step (every
``OPSD_PROFILE_EVERY``-th) with CUDA events, never making the host wait for them (:mod:`instrumentation.light`), one
event pair per run of consecutive calls of a stage, and writes the same scalars every step; no torch.profiler.

In both modes a timed step gets its own figures (MFU with ``prof.note_step_flops``, GPU busy, peak memory), the run a
layout and hparams (``prof.log_hparams``): :mod:`instrumentation.stepscalars`. ``log_step`` writes the loop's own
scalars (``train/<name>``) every step. Off, in ``nvtx`` mode and on unselected ranks the session only counts steps
(``log_step`` only checks its arguments). A failure of the machinery gives one warning per cause and the loop goes on.
Call ``prof.step()`` outside the ``opsd/step`` range.

Before anything starts, ``opsd_profiler()`` runs :func:`instrumentation.check_environment` (a bad ``OPSD_*`` value
raises ``ValueError`` naming it), and entering the session refuses (``ValueError`` naming ``OPSD_PROFILE_RUN_NAME``) a
run directory of another run or outside ``OPSD_PROFILE_DIR`` (:mod:`instrumentation.runmarker`); misuse (``step()``
outside ``with``, a session entered twice, sessions with timers nested) too (:mod:`instrumentation.session_checks`).
"""

from __future__ import annotations

import glob
import os
import re
import time
from numbers import Real
from typing import Optional

from instrumentation import probe, rates, runfiles, session_checks, state, worklog
from instrumentation.collect import StageTable, format_stage_rows, summarize
from instrumentation.config import ProfileConfig
from instrumentation.environment import check_environment
from instrumentation.export import TRACE_SUFFIX
from instrumentation.light import PendingSteps
from instrumentation.scalars import ScalarWriter
from instrumentation.steplog import StepLog
from instrumentation.timers import HUB
from instrumentation.tracing import TraceWindows

_SCALAR_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")


class _StepSink:
    """Receives the stage records of one timed step; peaks may be reset in mode ``1``; in mode
    ``timers`` runs of calls are coalesced (:mod:`instrumentation.light`)."""

    def __init__(self, allows_reset: bool, coalesce_runs: bool = False):
        self.allows_reset = allows_reset
        self.coalesce_runs = coalesce_runs
        self.records: list = []
        self.t0 = time.perf_counter()
        self.flops: Optional[float] = None  # prof.note_step_flops

    def add(self, record) -> None:
        self.records.append(record)


def check_scalars(step, values: dict) -> None:
    """``ValueError`` naming the argument when ``step`` or a scalar of ``log_step`` is not valid."""
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError(f"step must be an int >= 0 or None; got {step!r}")
    for name, value in values.items():
        if not _SCALAR_NAME.match(name):
            raise ValueError(f"scalar name {name!r} is not valid; accepted: letters, digits, '_.-'")
        if value is not None and (isinstance(value, bool) or not isinstance(value, Real)):
            raise ValueError(f"{name} must be a real number or None; got {type(value).__name__}")


def _warn_if_no_rank_writes(config: ProfileConfig, rank: int, world_size: int) -> None:
    """One warning, naming ``OPSD_PROFILE_RANKS``, when it selects no rank below the world size (a run that
    would write nothing and say nothing); a rank left out while another writes is normal and silent."""
    if config.ranks is None or config.ranks[0] < world_size:
        return
    state.warn_once("ranks", f"OPSD_PROFILE_RANKS selects rank {','.join(map(str, config.ranks))}, none of this "
                             f"run's (world size {world_size}; this process is rank {rank}): no traces or scalars "
                             "are written")


class ProfilerSession:
    """See the module docstring; build it with :func:`opsd_profiler`."""

    def __init__(self, config: Optional[ProfileConfig] = None, rank: Optional[int] = None,
                 world_size: Optional[int] = None):
        if config is not None and not isinstance(config, ProfileConfig):
            raise ValueError(f"config must be a ProfileConfig or None; got {type(config).__name__}")
        check_environment()  # every OPSD_* variable, before anything starts
        self._explicit_config = config
        self.rank, self.world_size = runfiles.resolve_rank(rank, world_size)
        session_checks.check_world(self.rank, self.world_size, world_size)
        self.config: Optional[ProfileConfig] = None
        self.run_dir: Optional[str] = None
        """``<output_dir>/<run_name>``; None when nothing is written on this rank."""
        self.scalars_dir: Optional[str] = None
        self.current_step = 0
        self.recorded_steps: list[int] = []
        """Steps whose stage times are in :meth:`stage_rows` (in mode ``timers``: once resolved)."""
        self.selected = False
        """Whether this rank times and writes (modes ``1`` / ``timers``, ``OPSD_PROFILE_RANKS``)."""
        self._table = StageTable()
        self._sink: Optional[_StepSink] = None
        self._traces: Optional[TraceWindows] = None
        self._scalars = ScalarWriter(None)
        self._pending: Optional[PendingSteps] = None
        self._work: Optional[worklog.WorkLog] = None
        """The run's work sidecar (:mod:`instrumentation.worklog`); None when nothing is written."""
        self._previous_config: Optional[ProfileConfig] = None
        self._swapped_config = False
        self._steps = StepLog(self._scalars)  # the timed steps' own figures (instrumentation.steplog)
        self._phase = "new"  # "open" inside its `with`, then "closed" (instrumentation.session_checks)

    # -- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> "ProfilerSession":
        active = state.get_config()
        config = self._explicit_config or active
        session_checks.check_enter(self._phase, config.stage_timers, HUB.num_sessions)
        self._phase = "open"
        if config.stage_timers:  # may refuse the run (ValueError) before anything has changed
            run_name, run_id = runfiles.shared_run(config, self.world_size)
            self.selected = config.selects_rank(self.rank)
            _warn_if_no_rank_writes(config, self.rank, self.world_size)
            if self.selected:
                self.run_dir = runfiles.make_run_dir(config.output_dir, run_name, run_id)
        if config != active:  # the ranges must follow the session's config; restored on exit
            self._previous_config, self._swapped_config = state.configure(config), True
        self.config = config
        if not config.stage_timers:
            return self
        HUB.num_sessions += 1
        if not self.selected:
            return self
        if self.run_dir is not None:
            self.scalars_dir = os.path.join(self.run_dir, f"rank{self.rank}")
            self._scalars = ScalarWriter(self.scalars_dir)
            self._steps = StepLog.of_session(self._scalars, config, self.rank, self.world_size, os.environ)
            if config.timing:
                self._traces = TraceWindows.start(config, self.run_dir, self.rank)
            self._work = worklog.WorkLog(worklog.work_path(self.run_dir, self.rank), self.rank,  # probe: once a run
                                         rates.resolve_rates(os.environ, rates.device_name(),
                                                             probe.probe_rates(os.environ)))
        if config.light:
            self._pending = PendingSteps(HUB.backend)
        self._begin_step()
        return self

    def step(self) -> None:
        """Mark the end of the current training step (call it after every step, inside the session's ``with``)."""
        session_checks.check_step(self._phase)
        if not self.selected:
            self.current_step += 1
            return
        self._end_step()
        self.current_step += 1
        if self._traces is not None:
            self._traces.step()
        self._begin_step()

    def log_step(self, step: Optional[int] = None, **scalars) -> None:
        """Write the loop's scalars of training step ``step`` (default: the current one) as ``train/<name>`` (e.g.
        ``loss=``, ``tokens_per_s=``, ``step_ms=``, ``mfu=``; None skips one). Arguments are checked in every mode
        (``ValueError`` naming the bad one); they are written in modes ``1`` and ``timers`` on the selected ranks."""
        check_scalars(step, scalars)
        if self.selected:
            self._scalars.train(self.current_step if step is None else step,
                                {k: float(v) if v is not None else None for k, v in scalars.items()})

    def note_step_flops(self, flops) -> None:
        """The current step's model FLOPs (``instrumentation.mfu.opsd_step_flops``, as ``train/mfu``) for its
        ``opsd/step_mfu``; call it before ``prof.step()``. ``ValueError`` unless None or a finite number >= 0."""
        if flops is not None and (isinstance(flops, bool) or not isinstance(flops, Real) or not 0 <= flops < 1e300):
            raise ValueError(f"flops must be a finite number >= 0; got {flops!r}")
        if self._sink is not None and flops is not None:
            self._sink.flops = float(flops)

    def log_hparams(self, **values) -> None:
        """Add the loop's settings (e.g. its flags) to the run's hparams; call it before the first step."""
        check_scalars(None, {name: None for name in values})
        self._steps.add_hparams(values)

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self._phase != "open":
            return False
        self._phase = "closed"
        try:
            if self.selected:
                if self._traces is not None:
                    self._traces.maybe_dump_oom(exc_type, self._sink is not None)
                self._end_step()
                self._resolve(force=True)
                if self._traces is not None:
                    self._traces.stop()
                self._scalars.close()
        finally:
            if self.config is not None and self.config.stage_timers:
                HUB.num_sessions = max(0, HUB.num_sessions - 1)
            if self._swapped_config and self._previous_config is not None:
                state.configure(self._previous_config)
        return False

    # -- results ---------------------------------------------------------------------------
    def trace_paths(self) -> list[str]:
        """This rank's trace files in this run so far (sorted by time): only complete, validated files carry a trace's
        name (see :mod:`instrumentation.export`)."""
        if self.run_dir is None:
            return []
        return sorted(glob.glob(os.path.join(self.run_dir, f"rank{self.rank}.*{TRACE_SUFFIX}")))

    def stage_rows(self, with_warmup: bool = False) -> list[dict]:
        """Live per-stage table over the timed steps after the warm-up step 0 (see ``StageTable.rows``;
        ``with_warmup``: over every timed step)."""
        return self._table.rows(with_warmup)

    def warmup_rows(self) -> list[dict]:
        """The warm-up step's own rows (step 0 when it was timed; empty otherwise)."""
        return self._table.warmup.rows() if self._table.warmup.num_steps else []

    def stage_table(self, title: Optional[str] = None) -> str:
        """:meth:`stage_rows` as fixed-width text, then the warm-up step's rows apart when later steps were timed."""
        text = format_stage_rows(self.stage_rows(), title)
        if self._table.warmup.num_steps and self._table.num_steps:
            text += "\n" + format_stage_rows(self.warmup_rows(), "warm-up step 0, apart (captures, compilation)")
        return text

    # -- steps -----------------------------------------------------------------------------
    def _begin_step(self) -> None:
        if self.config.times_step(self.current_step):
            self._sink = _StepSink(allows_reset=self.config.timing, coalesce_runs=self.config.light)
            HUB.add_sink(self._sink)
            self._steps.begin(HUB.backend)
            worklog.RECORDER.begin(self._work, self.current_step)

    def _end_step(self) -> None:
        works = worklog.RECORDER.end()  # written to the sidecar; kept for the step's x roofline scalars
        sink, self._sink = self._sink, None
        if sink is None:
            return
        HUB.flush()  # the run still held (e.g. the last decode calls) belongs to this step
        HUB.remove_sink(sink)
        wall_ms = (time.perf_counter() - sink.t0) * 1e3
        self._steps.end(self.current_step, sink.records, sink.flops, HUB.backend, works)
        if not sink.records:
            return
        if self._pending is not None:
            self._pending.add(self.current_step, sink.records, wall_ms)
            self._resolve(force=False)
            return
        try:
            summary = summarize(sink.records, HUB.backend)
        except Exception as exc:
            state.warn_once("summarize", f"opsd stage timers could not be resolved: {exc!r}")
            return
        self._add_step(self.current_step, summary, wall_ms)

    def _resolve(self, force: bool) -> None:
        """Record the timed steps of mode ``timers`` whose device times are known by now."""
        if self._pending is None:
            return
        try:
            ready = self._pending.pop_ready(force)
        except Exception as exc:
            state.warn_once("summarize", f"opsd stage timers could not be resolved: {exc!r}")
            self._pending = None
            return
        for step, summary, wall_ms in ready:
            self._add_step(step, summary, wall_ms)

    def _add_step(self, step: int, summary: dict, wall_ms: float) -> None:
        self.recorded_steps.append(step)
        warmup = step == 0 and self._table.warmup.num_steps == 0
        self._table.add_step(summary, wall_ms, warmup=warmup)
        self._steps.write(step, summary, wall_ms, warmup, HUB.backend.has_device_clock, self.config.timing)


def opsd_profiler(config: Optional[ProfileConfig] = None, rank: Optional[int] = None,
                  world_size: Optional[int] = None) -> ProfilerSession:
    """A :class:`ProfilerSession` for ``with opsd_profiler() as prof: ...; prof.step()``. ``config`` defaults to the
    process-wide active config; an explicit one becomes the active config for the duration of the session (so
    ``stage()`` ranges follow it)."""
    return ProfilerSession(config, rank, world_size)


__all__ = ["ProfilerSession", "opsd_profiler", "check_scalars"]

"""TensorBoard scalars of a profiler session: per-stage times per step and the training scalars.

Tags (the same as ``opsd-summarize --tensorboard`` writes from traces; x = the training step index,
0-based, as counted by ``prof.step()`` and named by ``OPSD_PROFILE_STEPS``):

* ``opsd/<stage>/cpu_ms``: host time of the stage's calls in the step (``time.perf_counter``);
* ``opsd/<stage>/gpu_ms``: device time between CUDA events recorded around each call on the current
  stream, summed (CUDA only; in mode ``timers`` around each run of consecutive calls:
  :mod:`instrumentation.light`);
* ``opsd/<stage>/peak_allocated_mib``: peak of the CUDA caching allocator during the stage (recorded
  steps of mode ``1`` only);
* ``train/<name>``: what the loop passes to ``prof.log_step`` (``loss``, ``tokens_per_s``,
  ``step_ms``, ``mfu`` ...);
* the step's own figures, ``opsd/step_mfu``, ``opsd/step_gpu_busy``, ``opsd/step_peak_allocated_mib``,
  ``opsd/step_peak_reserved_mib`` and ``opsd/<stage>/x_roofline`` (:mod:`instrumentation.stepscalars`).

The warm-up step's ``opsd/`` scalars go under ``warmup/`` (:mod:`instrumentation.stepscalars`). Once per run the
writer adds a custom-scalars layout (:func:`instrumentation.stepscalars.layout`) and the run's config as hparams,
both into the same event file (no extra run directory, unlike ``SummaryWriter.add_hparams``).

A writer that cannot be created or written gives one warning and is dropped; training goes on.

Writing never waits for the disk: ``SummaryWriter``'s default queue holds 10 events, and an ``add_scalar``
that finds it full blocks the training thread until TensorBoard's writer thread has taken one (a step of
light mode writes ~20-60 scalars). The queue here holds :data:`MAX_QUEUE` events, and the writer thread
flushes every :data:`FLUSH_SECS` seconds, so a live TensorBoard lags by at most that.
"""

from __future__ import annotations

from typing import Optional

from instrumentation import stages, state

MAX_QUEUE = 4096
"""Events ``add_scalar`` can queue before it would block (~100 bytes each)."""
FLUSH_SECS = 30
"""How often TensorBoard's writer thread flushes the event file."""


class ScalarWriter:
    """A lazily created ``SummaryWriter`` in ``log_dir`` (see the module docstring)."""

    def __init__(self, log_dir: Optional[str]):
        self.log_dir = log_dir
        self._writer = None

    def _get(self):
        if self._writer is None and self.log_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=self.log_dir, max_queue=MAX_QUEUE, flush_secs=FLUSH_SECS)
        return self._writer

    def _guarded(self, write) -> None:
        if self.log_dir is None:
            return
        try:
            write(self._get())
        except Exception as exc:
            state.warn_once("scalars", f"opsd TensorBoard scalars disabled: {exc!r}")
            self.log_dir = None

    @staticmethod
    def _write_step(writer, step: int, tagged: list) -> None:
        """All ``(tag, value)`` scalars of one step as one event (one ``Summary`` with a value per tag):
        TensorBoard reads them exactly as ``add_scalar``'s one-value events, for a fraction of the host
        time (one event built, serialised and queued per step instead of one per scalar)."""
        if not tagged:
            return
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=tag, simple_value=float(value)) for tag, value in tagged]
        writer._get_file_writer().add_summary(Summary(value=values), step)

    def stages(self, step: int, summary: dict, has_device_clock: bool, flush: bool = True,
               prefix: str = "") -> None:
        """Per-stage scalars of one step from ``collect.summarize`` output (tags after ``prefix``)."""
        head = prefix

        def write(writer) -> None:
            tagged = []
            for name, entry in summary.items():
                prefix = head + stages.range_name(name) + "/"
                tagged.append((prefix + "cpu_ms", entry["host_ms"]))
                if has_device_clock:
                    tagged.append((prefix + "gpu_ms", entry["device_ms"]))
                if entry["peak_allocated_mib"] is not None:
                    tagged.append((prefix + "peak_allocated_mib", entry["peak_allocated_mib"]))
            self._write_step(writer, step, tagged)
            if flush:
                writer.flush()

        self._guarded(write)

    def train(self, step: int, values: dict) -> None:
        """``train/<name>`` scalars of one step (None values are skipped)."""
        def write(writer) -> None:
            self._write_step(writer, step, [(f"train/{name}", value) for name, value in values.items()
                                            if value is not None])

        self._guarded(write)

    def values(self, step: int, tagged: list) -> None:
        """``(tag, value)`` scalars of one step as they are (one event)."""
        self._guarded(lambda writer: self._write_step(writer, step, tagged))

    def layout_and_hparams(self, layout: dict, hparams: dict, metrics) -> None:
        """The custom-scalars ``layout`` and the run's ``hparams`` (with ``metrics``, tags, as the hparams table's
        columns), written into this writer's own event file."""
        def write(writer) -> None:
            from torch.utils.tensorboard.summary import hparams as hparams_summaries

            writer.add_custom_scalars(layout)
            for summary in hparams_summaries(hparams, dict.fromkeys(metrics, 0.0)):  # experiment, session start/end
                writer._get_file_writer().add_summary(summary)

        self._guarded(write)

    def flush(self) -> None:
        """Hand what is queued to the disk now (mode ``1``: its few recorded steps show at once)."""
        self._guarded(lambda writer: writer.flush())

    def close(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            try:
                writer.close()
            except Exception as exc:
                state.warn_once("scalars", f"opsd TensorBoard scalars disabled: {exc!r}")

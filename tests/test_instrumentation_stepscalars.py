"""Issue 33: timers mode's own scalars per timed step (MFU with a settable peak, GPU busy, peak memory), the
warm-up step apart, the custom-scalars layout and the hparams, in the run's one event file."""

import glob
import os
import time

import pytest
import torch

from instrumentation import ProfileConfig, configure, stage, stages
from instrumentation.backends import STEP_PEAKS, CpuBackend, CudaBackend
from instrumentation.profiler import opsd_profiler
from instrumentation.stepscalars import StepFacts, layout, step_figures, top_level_stages, x_roofline
from instrumentation.timers import HUB, StageRecord, StageTimers
from instrumentation.work import StageWork
from tests.profiling_env import RecordingSink, clean_profiling_env  # noqa: F401  (autouse fixture)
from tests.test_instrumentation_profiler import _scalars
from tests.test_opsd_step import load_train_opsd, tiny_step

MIB = 1024 * 1024


def _config(tmp_path, **kwargs):
    return ProfileConfig.from_env({}, **{"mode": "timers", "output_dir": str(tmp_path / "traces"), **kwargs})


class FakeGpu:
    """A device clock the test advances (``run``), and allocator peaks that phase resets fold, as CudaBackend's."""

    tracks_memory, has_device_clock = True, True

    def __init__(self):
        self.clock, self.allocated, self.reserved, self.num_resets = 0.0, 0, 0, 0

    def run(self, ms, allocated=0):
        self.clock += ms
        self.allocated, self.reserved = max(self.allocated, allocated), max(self.reserved, 2 * allocated)

    def mark(self):
        return self.clock

    def elapsed_ms(self, start, end):
        return end - start

    def is_done(self, mark):
        return True

    def release(self, marks):
        pass

    def max_allocated_bytes(self):
        return self.allocated

    def peak_bytes(self):
        return self.allocated, self.reserved

    def reset_peak(self):
        if STEP_PEAKS.active:
            STEP_PEAKS.fold(*self.peak_bytes())
        self.num_resets += 1
        self.allocated = self.reserved = 0


def test_timers_mode_writes_mfu_gpu_busy_and_peaks_per_step_and_the_warmup_apart(tmp_path, monkeypatch):
    gpu = FakeGpu()
    monkeypatch.setattr(HUB, "_backend", gpu)
    monkeypatch.setenv("OPSD_PEAK_TFLOPS", "0.5")  # the user's peak (OPSD_PEAK_TFLOPS), on any device
    configure(_config(tmp_path))
    with opsd_profiler() as prof:
        for index in range(3):
            with stage(stages.STEP):
                with stage(stages.ROLLOUT):
                    with stage(stages.DECODE):  # nested: inside the rollout's time, not counted again
                        gpu.run(5.0, allocated=100 * MIB)
                gpu.reset_peak()  # a phase resets the peak (PhaseTimer does): the step's peak survives it
                with stage(stages.LOSS):
                    gpu.run(3.0, allocated=(10 + index) * MIB)
            prof.note_step_flops(1e9 * (index + 1))
            prof.step()
    scalars = _scalars(prof.scalars_dir)
    for name in ("step_mfu", "step_gpu_busy", "step_peak_allocated_mib", "step_peak_reserved_mib"):
        assert [s for s, _ in scalars[f"opsd/{name}"]] == [1, 2]  # the warm-up step 0 is apart:
        assert [s for s, _ in scalars[f"warmup/opsd/{name}"]] == [0]
    assert [s for s, _ in scalars["opsd/decode/gpu_ms"]] == [1, 2] and "warmup/opsd/decode/gpu_ms" in scalars
    step_ms = dict(scalars["opsd/step/cpu_ms"])
    for step, value in scalars["opsd/step_mfu"]:
        assert value == pytest.approx(1e9 * (step + 1) / (step_ms[step] / 1e3 * 0.5e12), rel=1e-4)
    for step, value in scalars["opsd/step_gpu_busy"]:  # rollout 5 ms + loss 3 ms of GPU over the step's host ms
        assert value == pytest.approx(8.0 / step_ms[step], rel=1e-4)
    assert scalars["opsd/step_peak_allocated_mib"] == [(1, 100.0), (2, 100.0)]  # the rollout's, before the reset
    assert scalars["opsd/step_peak_reserved_mib"] == [(1, 200.0), (2, 200.0)]
    assert not STEP_PEAKS.active


def test_no_flops_or_no_peak_writes_no_mfu(tmp_path, monkeypatch):
    # the CPU's case on any machine: host timers only, and a device with no data-sheet peak
    monkeypatch.setattr(HUB, "_backend", CpuBackend())
    monkeypatch.setattr("instrumentation.rates.device_name", lambda: "cpu")
    configure(_config(tmp_path))
    with opsd_profiler() as prof:
        for _ in range(2):
            with stage(stages.STEP):
                pass
            prof.note_step_flops(1e9)  # the CPU: no data-sheet peak and no OPSD_PEAK_TFLOPS
            prof.step()
    scalars = _scalars(prof.scalars_dir)
    assert not any("step_mfu" in tag or "step_gpu_busy" in tag or "step_peak" in tag for tag in scalars)
    with pytest.raises(ValueError, match="flops must be"):
        prof.note_step_flops(-1.0)


def _plugin_values(scalars_dir):
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    (path,) = glob.glob(os.path.join(scalars_dir, "events.out.tfevents.*"))
    return {v.tag: v for e in EventFileLoader(path).Load() if e.HasField("summary") for v in e.summary.value
            if v.metadata.plugin_data.plugin_name in ("custom_scalars", "hparams")}


def test_the_run_gets_a_custom_scalars_layout_and_its_config_as_hparams_in_its_own_run(tmp_path, monkeypatch):
    from tensorboard.plugins.custom_scalar import layout_pb2
    from tensorboard.plugins.hparams import plugin_data_pb2

    monkeypatch.setattr("instrumentation.rates.device_name", lambda: "cpu")  # the CPU's case on any machine
    configure(_config(tmp_path))
    with opsd_profiler() as prof:
        prof.log_hparams(batch_size=4, lr=None, student="qwen25-3b")
        for _ in range(2):
            with stage(stages.STEP):
                with stage(stages.ROLLOUT), stage(stages.DECODE):
                    pass
                with stage(stages.BACKWARD):
                    pass
            prof.step()
    assert os.listdir(prof.scalars_dir) == [os.path.basename(p) for p in glob.glob(prof.scalars_dir + "/*")]
    assert not [p for p in os.listdir(prof.scalars_dir) if os.path.isdir(os.path.join(prof.scalars_dir, p))]
    values = _plugin_values(prof.scalars_dir)
    assert {"custom_scalars__config__", "_hparams_/experiment", "_hparams_/session_start_info"} <= set(values)
    charts = layout_pb2.Layout.FromString(values["custom_scalars__config__"].tensor.string_val[0])
    (category,) = charts.category
    by_title = {c.title: list(c.multiline.tag) for c in category.chart}
    (gpu_regex,) = by_title["GPU ms per phase (opsd/step = total)"]
    assert gpu_regex == "^opsd/(backward|rollout|step)/gpu_ms$"  # the step's phases, not the nested decode
    assert by_title["MFU and GPU busy (fractions)"] == ["opsd/step_mfu", "opsd/step_gpu_busy", "train/mfu"]
    start = plugin_data_pb2.HParamsPluginData.FromString(
        values["_hparams_/session_start_info"].metadata.plugin_data.content).session_start_info
    hparams = {k: v.WhichOneof("kind") and getattr(v, v.WhichOneof("kind")) for k, v in start.hparams.items()}
    assert hparams["profile_mode"] == "timers" and hparams["batch_size"] == 4 and hparams["lr"] == "-"
    assert hparams["student"] == "qwen25-3b" and hparams["device"] == "cpu" and hparams["peak_tflops"] == "-"
    experiment = plugin_data_pb2.HParamsPluginData.FromString(
        values["_hparams_/experiment"].metadata.plugin_data.content).experiment
    assert "opsd/step_mfu" in {m.name.tag for m in experiment.metric_infos}


def test_step_figures_and_x_roofline_are_pure_functions():
    summary = {"step": {"host_ms": 100.0, "device_ms": 95.0}, "rollout": {"host_ms": 60.0, "device_ms": 50.0},
               "decode": {"host_ms": 40.0, "device_ms": 45.0}, "backward": {"host_ms": 20.0, "device_ms": 30.0}}
    facts = StepFacts(frozenset({"rollout", "backward"}), flops=2e12, peak_allocated_bytes=3 * MIB)
    figures = step_figures(summary, 150.0, facts, True, 1e14)
    assert figures == pytest.approx({"mfu": 2e12 / (0.1 * 1e14), "gpu_busy": 0.8, "peak_allocated_mib": 3.0})
    assert step_figures(summary, 150.0, facts, False, None) == {"peak_allocated_mib": 3.0}  # CPU: no clock, no peak
    del summary["step"]  # no opsd/step range: the time between two prof.step()
    assert step_figures(summary, 160.0, facts, True, 1e14)["gpu_busy"] == pytest.approx(0.5)
    works = [StageWork("backward", 4, 64, 1e12, 1e9)]  # roofline max(10 ms compute, 1 ms copy) = 10 ms
    assert x_roofline(summary, works, 1e14, 1e12) == pytest.approx({"backward": 3.0})
    assert x_roofline(summary, works, None, 1e12) == {}
    assert "Multiline" in layout({"rollout"})["opsd step"]["peak memory MiB"]


def test_records_name_their_parent_and_the_top_level_is_the_steps_phases():
    hub, sink = StageTimers(FakeGpu()), RecordingSink()
    hub.add_sink(sink)
    step = hub.open(stages.STEP)
    rollout = hub.open(stages.ROLLOUT)
    for _ in range(3):
        hub.close(hub.open(stages.DECODE))
    hub.close(rollout)
    hub.close(hub.open(stages.LOSS))
    hub.close(step)
    hub.close(hub.open(stages.OPTIMIZER_STEP))  # outside the step range: a phase as well
    hub.remove_sink(sink)
    assert [(r.stage, r.calls, r.parent) for r in sink.records] == [
        ("decode", 3, "rollout"), ("rollout", 1, "step"), ("loss", 1, "step"), ("step", 1, None),
        ("optimizer_step", 1, None)]
    assert top_level_stages(sink.records) == {"rollout", "loss", "optimizer_step"}
    assert top_level_stages([StageRecord("decode", 1.0, None, None)]) == {"decode"}


def test_cuda_backend_folds_the_step_peak_before_each_reset():
    """The real fold: CudaBackend.reset_peak reads the allocator's statistics (no device sync) before resetting."""
    backend = object.__new__(CudaBackend)
    stats = {"allocated_bytes": {"all": {"peak": 700}}, "reserved_bytes": {"all": {"peak": 900}}}
    resets = []
    backend._device, backend._raw_stats = (lambda: 0), (lambda device: stats)
    backend._raw_reset = lambda device: resets.append(device)
    STEP_PEAKS.begin(backend)
    stats["allocated_bytes"]["all"]["peak"], stats["reserved_bytes"]["all"]["peak"] = 500, 800  # a later phase
    backend.reset_peak()
    stats["allocated_bytes"]["all"]["peak"], stats["reserved_bytes"]["all"]["peak"] = 200, 300
    assert STEP_PEAKS.end(backend) == (500, 800) and len(resets) == 2  # the step's peak, not the last phase's
    assert not STEP_PEAKS.active
    backend.reset_peak()  # outside a step nothing is folded
    assert (STEP_PEAKS.allocated, len(resets)) == (500, 3)


def test_the_main_job_hands_its_step_flops_to_the_session(tmp_path, monkeypatch):
    """The tiny OPSD job in timers mode: opsd/step_mfu from the FLOPs of train/mfu (one implementation) over the
    session's peak (OPSD_PEAK_TFLOPS), the job's flags as hparams."""
    train_opsd = load_train_opsd("_train_opsd_stepscalars")
    monkeypatch.setenv("OPSD_PEAK_TFLOPS", "1e-3")
    configure(_config(tmp_path))
    job, opsd_config = train_opsd.parse_args(["--steps", "3", "--max-new-tokens", "4", "--peak-tflops", "1e-3"])
    step = tiny_step(job, opsd_config, monkeypatch)
    results, prof = train_opsd.train(step, job, 0, torch.device("cpu"))
    scalars = _scalars(prof.scalars_dir)
    assert [s for s, _ in scalars["opsd/step_mfu"]] == [1, 2] and [s for s, _ in scalars["warmup/opsd/step_mfu"]] == [0]
    step_ms = dict(scalars["opsd/step/cpu_ms"])
    train_mfu = dict(scalars["train/mfu"])  # flops / (result.step_ms * the same peak), the loop's own
    for index, value in scalars["opsd/step_mfu"]:
        flops = train_mfu[index] * results[index].step_ms / 1e3 * 1e9
        assert value == pytest.approx(flops / (step_ms[index] / 1e3 * 1e9), rel=1e-3)
    values = _plugin_values(prof.scalars_dir)
    assert b"max_new_tokens" in values["_hparams_/session_start_info"].metadata.plugin_data.content


class HostClock(FakeGpu):
    """A device clock that is the host's (the CPU has none), no allocator: lets the main job's timers-mode scalars
    that need a clock (GPU ms, x roofline) be checked on the CPU."""

    tracks_memory = False

    def mark(self):
        return time.perf_counter() * 1e3


def test_timers_mode_writes_each_phases_x_roofline_from_the_steps_work_records(tmp_path, monkeypatch):
    """The tiny OPSD job in timers mode with both rates set: opsd/<stage>/x_roofline for every stage with a work
    record, equal to the stage's GPU ms over the roofline_s of the work sidecar (the figure summarize_trace.py
    divides by); the warm-up step apart."""
    import json

    from instrumentation.work import WORK_STAGES

    train_opsd = load_train_opsd("_train_opsd_stepscalars")
    monkeypatch.setattr(HUB, "_backend", HostClock())
    monkeypatch.setenv("OPSD_PEAK_TFLOPS", "1e-3")
    monkeypatch.setenv("OPSD_PEAK_TBPS", "1e-4")
    configure(_config(tmp_path))
    job, opsd_config = train_opsd.parse_args(["--steps", "3", "--max-new-tokens", "4"])
    step = tiny_step(job, opsd_config, monkeypatch)
    _, prof = train_opsd.train(step, job, 0, torch.device("cpu"))
    scalars = _scalars(prof.scalars_dir)
    with open(os.path.join(prof.run_dir, "rank0.work.jsonl"), encoding="utf-8") as f:
        sidecar = {(w["step"], w["stage"]): w for w in map(json.loads, f)}
    assert {stage for _, stage in sidecar} >= {stages.DECODE, stages.TEACHER_FORWARD, stages.STUDENT_FORWARD,
                                               stages.BACKWARD, stages.OPTIMIZER_STEP}
    checked = 0
    for stage_name in WORK_STAGES:
        tag = f"opsd/{stage_name}/x_roofline"
        if f"opsd/{stage_name}/gpu_ms" not in scalars:
            continue
        assert [s for s, _ in scalars[tag]] == [1, 2] and [s for s, _ in scalars["warmup/" + tag]] == [0]
        gpu_ms = dict(scalars[f"opsd/{stage_name}/gpu_ms"])
        for index, value in scalars[tag]:
            expected = gpu_ms[index] / (sidecar[(index, stage_name)]["roofline_s"] * 1e3)
            assert value == pytest.approx(expected, rel=1e-4)
            checked += 1
    assert checked >= 2 * 5

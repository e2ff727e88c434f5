"""Stage timers: nested peak memory, device events, sinks, collect_stages, the live table."""

from contextlib import nullcontext

import pytest
import torch

from instrumentation import ProfileConfig, configure, stages
from instrumentation.collect import StageCollector, StageTable, collect_stages, format_stage_rows, summarize
from instrumentation.ranges import stage
from instrumentation.timers import BYTES_PER_MIB, HUB, CpuBackend, StageRecord, StageTimers
from tests.profiling_env import clean_profiling_env  # noqa: F401  (autouse fixture)

MIB = BYTES_PER_MIB


class FakeAllocator:
    """A caching-allocator model: ``max_allocated`` since the last reset, plus a fake device clock."""

    tracks_memory = True

    def __init__(self):
        self.allocated = 0
        self.peak = 0
        self.num_resets = 0
        self.clock_ms = 0.0
        self.num_marks = 0
        self.released = []

    def alloc(self, nbytes):
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)

    def free(self, nbytes):
        self.allocated -= nbytes

    def max_allocated_bytes(self):
        return self.peak

    def reset_peak(self):
        self.num_resets += 1
        self.peak = self.allocated

    def mark(self):
        self.num_marks += 1
        return self.clock_ms

    def elapsed_ms(self, start, end):
        return end - start

    def release(self, marks):
        self.released += list(marks)


class ListSink:
    def __init__(self, allows_reset=True, coalesce_runs=False):
        self.allows_reset = allows_reset
        self.coalesce_runs = coalesce_runs
        self.records = []

    def add(self, record):
        self.records.append(record)


class FakeHostClock:
    """``time.perf_counter`` of the timers module, advanced by hand (seconds)."""

    def __init__(self):
        self.now = 100.0

    def perf_counter(self):
        return self.now


@pytest.fixture
def host_clock(monkeypatch):
    import instrumentation.timers as timers

    clock = FakeHostClock()
    monkeypatch.setattr(timers, "time", clock)
    return clock


def _light_hub(backend=None):
    """A hub whose only sink coalesces runs (the light mode's step sink), peaks not tracked."""
    hub = StageTimers(backend or FakeAllocator())
    sink = ListSink(allows_reset=False, coalesce_runs=True)
    hub.add_sink(sink)
    return hub, sink


def _call(hub, alloc, host_clock, name, device_ms=1.0, host_ms=1.0):
    frame = hub.open(name)
    alloc.clock_ms += device_ms
    host_clock.now += host_ms / 1e3
    return hub.close(frame)


def _calls(records, name):
    return [r.calls for r in records if r.stage == name]



def _peaks(records):
    return {r.stage: r.peak_bytes for r in records}


def test_parent_peak_survives_a_reset_inside_a_child():
    alloc = FakeAllocator()
    hub = StageTimers(alloc)
    sink = ListSink()
    hub.add_sink(sink)
    step = hub.open(stages.STEP)
    alloc.alloc(100 * MIB)            # step peak 100 before the child
    alloc.free(100 * MIB)
    rollout = hub.open(stages.ROLLOUT)  # resets the allocator peak
    decode = hub.open(stages.DECODE)
    alloc.alloc(30 * MIB)             # decode peak 30
    alloc.free(30 * MIB)
    hub.close(decode)
    alloc.alloc(50 * MIB)             # rollout peak 50 (after decode)
    alloc.free(50 * MIB)
    hub.close(rollout)
    loss = hub.open(stages.LOSS)
    alloc.alloc(10 * MIB)
    hub.close(loss)                   # loss peak 10 (still allocated)
    hub.close(step)
    assert _peaks(sink.records) == {"decode": 30 * MIB, "rollout": 50 * MIB, "loss": 10 * MIB,
                                    "step": 100 * MIB}
    assert alloc.num_resets == 4 and hub.frames == []


def test_child_peak_propagates_to_parent():
    alloc = FakeAllocator()
    hub = StageTimers(alloc)
    sink = ListSink()
    hub.add_sink(sink)
    alloc.alloc(5 * MIB)              # already allocated before the step
    step = hub.open(stages.STEP)
    child = hub.open(stages.TEACHER_FORWARD)
    alloc.alloc(70 * MIB)
    alloc.free(70 * MIB)
    hub.close(child)
    grandchild_parent = hub.open(stages.STUDENT_FORWARD)
    grandchild = hub.open(stages.LOSS)
    alloc.alloc(20 * MIB)
    alloc.free(20 * MIB)
    hub.close(grandchild)
    hub.close(grandchild_parent)
    alloc.reset_peak()                # someone else resets: the step keeps its children's peaks
    hub.close(step)
    assert _peaks(sink.records) == {"teacher_forward": 75 * MIB, "loss": 25 * MIB,
                                    "student_forward": 25 * MIB, "step": 75 * MIB}


def test_no_resets_and_no_peaks_when_no_sink_allows_them():
    alloc = FakeAllocator()
    hub = StageTimers(alloc)
    sink = ListSink(allows_reset=False)
    hub.add_sink(sink)
    frame = hub.open(stages.PREFILL)
    alloc.alloc(MIB)
    hub.close(frame)
    assert alloc.num_resets == 0 and sink.records[0].peak_bytes is None


def test_device_time_comes_from_events_resolved_at_summary():
    alloc = FakeAllocator()
    hub = StageTimers(alloc)
    sink = ListSink()
    hub.add_sink(sink)
    for device_ms in (2.0, 3.0):
        frame = hub.open(stages.DECODE)
        alloc.clock_ms += device_ms
        hub.close(frame)
    assert all(r.resolved_device_ms is None for r in sink.records)  # nothing resolved per stage
    summary = summarize(sink.records, alloc)
    assert summary["decode"]["count"] == 2 and summary["decode"]["device_ms"] == 5.0
    assert summary["decode"]["host_ms"] >= 0.0


def test_cpu_device_time_is_host_time_and_peak_is_none():
    records = [StageRecord("prefill", 4.0, None, None), StageRecord("prefill", 1.5, None, None),
               StageRecord("step", 9.0, None, None)]
    summary = summarize(records, CpuBackend())
    assert list(summary) == ["step", "prefill"]  # stage order of the contract
    assert summary["prefill"] == {"count": 2, "host_ms": 5.5, "device_ms": 5.5, "peak_allocated_mib": None}


def test_records_go_only_to_sinks_open_at_frame_start():
    hub = StageTimers(CpuBackend())
    early, late = ListSink(), ListSink()
    hub.add_sink(early)
    outer = hub.open(stages.ROLLOUT)
    hub.add_sink(late)
    inner = hub.open(stages.DECODE)
    hub.close(inner)
    hub.remove_sink(early)
    hub.close(outer)
    assert [r.stage for r in early.records] == ["decode"]
    assert [r.stage for r in late.records] == ["decode"]


@pytest.mark.parametrize("mode", ["0", "nvtx"])
def test_collect_stages_yields_none_unless_mode_1(mode):
    configure(ProfileConfig(mode=mode))
    with collect_stages() as collector:
        with stage(stages.PREFILL):
            pass
    assert collector is None and HUB.sinks == []


def test_collect_stages_times_the_stages_inside_it():
    configure(ProfileConfig(mode="1"))
    with stage(stages.ROLLOUT):      # opened before the collector: not part of it
        with collect_stages() as collector:
            with stage(stages.PREFILL):
                torch.ones(16, 16) @ torch.ones(16, 16)
            for _ in range(3):
                with stage(stages.DECODE):
                    pass
    with stage(stages.LOSS):         # after the collector: not part of it
        pass
    summary = collector.summary()
    assert list(summary) == ["prefill", "decode"]
    assert [summary[s]["count"] for s in summary] == [1, 3]
    for entry in summary.values():
        assert set(entry) == {"count", "host_ms", "device_ms", "peak_allocated_mib"}
        assert entry["host_ms"] >= 0
        if not torch.cuda.is_available():
            assert entry["device_ms"] == entry["host_ms"] and entry["peak_allocated_mib"] is None


def test_collectors_reset_peaks_only_outside_sessions():
    hub = StageTimers(FakeAllocator())
    with StageCollector(hub) as alone:
        assert alone.allows_reset and hub.track_memory
    hub.num_sessions = 1
    with StageCollector(hub) as in_session:
        assert not in_session.allows_reset and not hub.track_memory


def test_stage_table_rows_and_format():
    table = StageTable()
    table.add_step({"step": {"count": 1, "host_ms": 10.0, "device_ms": 10.0, "peak_allocated_mib": None},
                    "decode": {"count": 4, "host_ms": 6.0, "device_ms": 6.0, "peak_allocated_mib": None}},
                   wall_ms=11.0)
    table.add_step({"step": {"count": 1, "host_ms": 30.0, "device_ms": 30.0, "peak_allocated_mib": 2.0},
                    "decode": {"count": 4, "host_ms": 2.0, "device_ms": 4.0, "peak_allocated_mib": 1.5}},
                   wall_ms=31.0)
    rows = table.rows()
    assert [r["stage"] for r in rows] == ["step", "decode"]
    assert rows[1] == {"stage": "decode", "count": 8, "total_ms": 10.0, "mean_ms": 1.25,
                       "host_total_ms": 8.0, "share_of_step": 0.25, "peak_mib": 1.5}
    assert rows[0]["share_of_step"] == 1.0 and rows[0]["peak_mib"] == 2.0
    text = format_stage_rows(rows, title="per-stage")
    assert text.splitlines()[0] == "per-stage"
    assert "25.0%" in text and "decode" in text


def test_share_uses_wall_time_without_a_step_range():
    table = StageTable()
    table.add_step({"loss": {"count": 1, "host_ms": 2.0, "device_ms": 2.0, "peak_allocated_mib": None}},
                   wall_ms=8.0)
    (row,) = table.rows()
    assert row["share_of_step"] == 0.25
    assert format_stage_rows([row]).splitlines()[-1].split()[-1] == "-"  # no peak: the null cell


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_peaks_are_nested_correctly_and_device_time_is_measured():
    configure(ProfileConfig(mode="1"))
    base_mib = torch.cuda.memory_allocated() / MIB
    with collect_stages() as collector:
        with stage(stages.STEP):
            big = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda")
            del big
            with stage(stages.DECODE):  # resets the allocator peak; the step must keep the 256 MiB
                small = torch.empty(16 * MIB, dtype=torch.uint8, device="cuda")
                x = torch.randn(1024, 1024, device="cuda")  # x: [1024, 1024]
                for _ in range(20):
                    x = torch.tanh(x @ x)
            del small
    summary = collector.summary()
    assert summary["step"]["peak_allocated_mib"] >= base_mib + 256
    assert base_mib + 16 <= summary["decode"]["peak_allocated_mib"] < base_mib + 256
    assert 0 < summary["decode"]["device_ms"] <= summary["step"]["device_ms"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_events_follow_the_current_stream():
    from instrumentation.timers import CudaBackend

    backend = CudaBackend()
    side = torch.cuda.Stream()
    assert backend._current_stream() == torch.cuda.current_stream()
    with torch.cuda.stream(side):
        assert backend._current_stream() == side
        start = backend.mark()
        x = torch.randn(2048, 2048, device="cuda")  # x: [2048, 2048]
        for _ in range(10):
            x = torch.tanh(x @ x)
        end = backend.mark()
    assert backend._current_stream() == torch.cuda.current_stream()
    assert backend.elapsed_ms(start, end) > 0


# -- run coalescing (light mode) ----------------------------------------------------------------


def test_a_run_of_calls_is_one_record_with_one_event_pair(host_clock):
    """5 decode calls in a row under the rollout: one record of 5 calls, the first call's start and
    the last call's end (the span, gaps between calls included), host times summed; each call after
    the first records only its end event and the previous end goes back to the pool."""
    alloc = FakeAllocator()
    hub, sink = _light_hub(alloc)
    rollout = hub.open(stages.ROLLOUT)
    marks_before = alloc.num_marks
    start = alloc.clock_ms
    for k in range(5):
        _call(hub, alloc, host_clock, stages.DECODE, device_ms=2.0, host_ms=0.5 + k)
        alloc.clock_ms += 0.25  # GPU work between the calls (e.g. sampling): inside the span
    end = alloc.clock_ms - 0.25
    assert alloc.num_marks - marks_before == 6  # 1 start + 5 ends, against 10 without coalescing
    hub.close(rollout)
    assert [r.stage for r in sink.records] == ["decode"]  # the rollout is held in turn ...
    hub.flush()                                           # ... until the step end takes the records
    decode = [r for r in sink.records if r.stage == stages.DECODE]
    assert [r.stage for r in sink.records] == ["decode", "rollout"]  # the run first: end-event order
    (run,) = decode
    assert run.calls == 5 and run.events == (start, end)
    assert run.host_ms == pytest.approx(0.5 + 1.5 + 2.5 + 3.5 + 4.5)
    assert run.device_ms(alloc) == pytest.approx(5 * 2.0 + 4 * 0.25)
    assert alloc.released == [start + 2.0, start + 4.25, start + 6.5, start + 8.75]  # the 4 earlier ends
    summary = summarize(sink.records, alloc)
    assert summary["decode"]["count"] == 5 and summary["rollout"]["count"] == 1


def test_another_stage_or_the_parent_closing_ends_a_run(host_clock):
    alloc = FakeAllocator()
    hub, sink = _light_hub(alloc)
    rollout = hub.open(stages.ROLLOUT)
    for name in (stages.DECODE, stages.DECODE, stages.CACHE_TRIM, stages.DECODE):
        _call(hub, alloc, host_clock, name)
    hub.close(rollout)
    rollout = hub.open(stages.ROLLOUT)  # its decode calls never extend the previous rollout's run
    _call(hub, alloc, host_clock, stages.DECODE)
    _call(hub, alloc, host_clock, stages.DECODE)
    hub.close(rollout)
    hub.flush()
    assert [(r.stage, r.calls) for r in sink.records] == [
        ("decode", 2), ("cache_trim", 1), ("decode", 1), ("decode", 2), ("rollout", 2)]  # 2 rollouts in a row
    summary = summarize(sink.records, alloc)
    assert summary["decode"]["count"] == 5 and summary["cache_trim"]["count"] == 1
    assert summary["decode"]["device_ms"] == 5.0 and hub.frames == []


def test_children_inside_a_call_do_not_break_its_run(host_clock):
    """The rule: nothing opened or closed BETWEEN two calls. A child inside a call is recorded on its
    own (and lies inside the run's span anyway); two children in different calls are two records."""
    alloc = FakeAllocator()
    hub, sink = _light_hub(alloc)
    rollout = hub.open(stages.ROLLOUT)
    for k in range(3):
        decode = hub.open(stages.DECODE)
        if k != 1:
            _call(hub, alloc, host_clock, stages.MASK_BUILD, device_ms=0.5)
        alloc.clock_ms += 1.0
        hub.close(decode)
    hub.close(rollout)
    hub.flush()
    assert [(r.stage, r.calls) for r in sink.records] == [
        ("mask_build", 1), ("mask_build", 1), ("decode", 3), ("rollout", 1)]
    assert sink.records[2].device_ms(alloc) == 4.0 and hub.frames == []


def test_a_non_coalescing_sink_turns_coalescing_off(host_clock):
    """collect_stages blocks and mode 1's steps check calls one by one: with one of them registered
    every sink gets one record (and one event pair) per call."""
    alloc = FakeAllocator()
    hub, light = _light_hub(alloc)
    per_call = ListSink(allows_reset=False)
    hub.add_sink(per_call)
    assert not hub.coalesce
    for _ in range(3):
        _call(hub, alloc, host_clock, stages.DECODE)
    assert alloc.num_marks == 6 and alloc.released == []
    assert _calls(per_call.records, "decode") == _calls(light.records, "decode") == [1, 1, 1]
    with StageCollector(hub) as collector:
        _call(hub, alloc, host_clock, stages.DECODE)
        _call(hub, alloc, host_clock, stages.DECODE)
    assert [r.calls for r in collector.records] == [1, 1]
    hub.remove_sink(per_call)
    assert hub.coalesce


def test_a_sink_change_or_flush_ends_the_run(host_clock):
    """Nothing lost or counted twice: the held run is delivered before a sink comes or goes, and a
    call open at a flush is timed on its own from then on (the device span is split, not lost)."""
    alloc = FakeAllocator()
    hub, sink = _light_hub(alloc)
    _call(hub, alloc, host_clock, stages.DECODE)
    _call(hub, alloc, host_clock, stages.DECODE)
    assert sink.records == []  # held: the next call may extend it
    late = ListSink(allows_reset=False, coalesce_runs=True)
    hub.add_sink(late)
    assert _calls(sink.records, "decode") == [2] and late.records == []
    _call(hub, alloc, host_clock, stages.DECODE)
    hub.remove_sink(late)  # delivered to both, then `late` leaves
    assert _calls(sink.records, "decode") == [2, 1] and _calls(late.records, "decode") == [1]
    _call(hub, alloc, host_clock, stages.DECODE, device_ms=1.0)
    frame = hub.open(stages.DECODE)  # extends the run ...
    alloc.clock_ms += 0.5
    hub.flush()                      # ... which ends here, mid-call
    alloc.clock_ms += 0.5
    hub.close(frame)
    hub.flush()
    assert _calls(sink.records, "decode") == [2, 1, 1, 1] and hub.frames == []
    assert [r.device_ms(alloc) for r in sink.records[2:]] == [1.5, 0.5]
    assert summarize(sink.records, alloc)["decode"]["count"] == 5
    frame = hub.open(stages.DECODE)  # opened before `later` comes: never part of a run it sees
    later = ListSink(allows_reset=False, coalesce_runs=True)
    hub.add_sink(later)
    hub.close(frame)
    _call(hub, alloc, host_clock, stages.DECODE)
    hub.flush()
    assert _calls(sink.records, "decode")[4:] == [1, 1] and _calls(later.records, "decode") == [1]


def test_an_exception_in_a_repeated_stage_closes_its_frame():
    configure(ProfileConfig(mode="timers"))
    sink = ListSink(allows_reset=False, coalesce_runs=True)
    HUB.add_sink(sink)
    with stage(stages.ROLLOUT):
        for k in range(4):
            with pytest.raises(RuntimeError) if k == 2 else nullcontext():
                with stage(stages.DECODE):
                    if k == 2:
                        raise RuntimeError("decode failed")
    HUB.remove_sink(sink)
    assert HUB.frames == [] and [(r.stage, r.calls) for r in sink.records] == [("decode", 4), ("rollout", 1)]


def test_cpu_runs_sum_host_times_and_device_time_is_host_time(host_clock):
    hub, sink = _light_hub(CpuBackend())
    for host_ms in (1.0, 2.0, 4.0):
        frame = hub.open(stages.DECODE)
        host_clock.now += host_ms / 1e3
        hub.close(frame)
    hub.flush()
    (run,) = sink.records
    assert run.calls == 3 and run.events is None
    assert summarize(sink.records, CpuBackend())["decode"] == pytest.approx(
        {"count": 3, "host_ms": 7.0, "device_ms": 7.0, "peak_allocated_mib": None})


def test_summarize_counts_calls_not_records():
    records = [StageRecord("decode", 6.0, None, None, calls=127), StageRecord("decode", 1.0, None, None)]
    assert summarize(records, CpuBackend())["decode"]["count"] == 128


@pytest.mark.parametrize("coalesce", [False, True], ids=["one record per call", "runs coalesced"])
def test_a_stage_nested_in_itself_is_timed_once(coalesce, host_clock, monkeypatch):
    """A loop wrapped in stage(STEP) around OPSDStep.step (which opens opsd/step itself): 3 steps, not 6."""
    from instrumentation import ProfilingWarning

    monkeypatch.setenv("RANK", "3")
    alloc = FakeAllocator()
    hub = StageTimers(alloc)
    sink = ListSink(allows_reset=False, coalesce_runs=coalesce)
    hub.add_sink(sink)
    with pytest.warns(ProfilingWarning) as caught:
        for _ in range(3):
            outer = hub.open(stages.STEP)
            assert hub.open(stages.STEP) is None  # the inner call: not timed, its range closes nothing
            _call(hub, alloc, host_clock, stages.ROLLOUT, device_ms=49.0, host_ms=49.0)
            host_clock.now += 0.051
            alloc.clock_ms += 51.0
            hub.close(outer)
    hub.flush()
    assert [str(w.message) for w in caught] == [
        "stage opsd/step opened inside opsd/step (rank 3): the inner call is not timed (counted once, as the "
        "outer call); wrap a stage once (OPSDStep.step opens opsd/step itself: docs/profiling.md)"]
    table = StageTable(keeps_warmup_apart=False)
    table.add_step(summarize(sink.records, alloc), wall_ms=300.0)
    rows = {r["stage"]: r for r in table.rows()}
    assert rows[stages.STEP]["count"] == 3 and rows[stages.STEP]["total_ms"] == pytest.approx(300.0)
    assert rows[stages.ROLLOUT]["share_of_step"] == pytest.approx(0.49)


def test_the_docs_loop_around_a_step_that_opens_opsd_step_counts_three_steps(tmp_path, monkeypatch):
    from instrumentation import ProfilingWarning
    from instrumentation.profiler import opsd_profiler

    for key, value in {"OPSD_PROFILE": "timers", "OPSD_PROFILE_DIR": str(tmp_path)}.items():
        monkeypatch.setenv(key, value)
    with pytest.warns(ProfilingWarning, match=r"stage opsd/step opened inside opsd/step \(rank 0\)"):
        with opsd_profiler() as prof:
            for _ in range(3):
                with stage(stages.STEP):          # the user's loop ...
                    with stage(stages.STEP):      # ... around OPSDStep.step, which opens it too
                        with stage(stages.ROLLOUT):
                            pass
                prof.step()
    counts = {r["stage"]: r["count"] for r in prof.stage_rows(with_warmup=True)}
    assert counts == {stages.STEP: 3, stages.ROLLOUT: 3}

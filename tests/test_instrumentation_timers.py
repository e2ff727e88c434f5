"""Stage timers: nested peak memory, device events, sinks, collect_stages, the live table."""

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
        return self.clock_ms

    def elapsed_ms(self, start, end):
        return end - start


class ListSink:
    def __init__(self, allows_reset=True):
        self.allows_reset = allows_reset
        self.records = []

    def add(self, record):
        self.records.append(record)




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

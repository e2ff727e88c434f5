"""Computations of traces/ on hand-built event lists: nesting, self time, GPU projection, memory
windows, ranks, duplicates, percentiles, share, steps and diff."""

import numpy as np
import pytest

from instrumentation import stages as S
from traces.diff import diff_rows
from traces.load import load
from traces.report import build_report
from traces.rows import Stats, StageRow, percentile
from traces.synth import annotation, gpu_op, launch, memory, write_events

STEP, ROLLOUT = S.range_name(S.STEP), S.range_name(S.ROLLOUT)
PREFILL, DECODE = S.range_name(S.PREFILL), S.range_name(S.DECODE)
BACKWARD = S.range_name(S.BACKWARD)


def report_of(tmp_path, events, prefix=S.PREFIX, name="t.json", **kw):
    path = write_events(str(tmp_path / name), events, **kw)
    loaded = load([path])
    assert not loaded.errors
    return build_report(loaded, prefix)


def row(report, name):
    return next(r for r in report.stages if r.name == name)


def test_nesting_and_self_time(tmp_path):
    events = [annotation(STEP, 0, 100), annotation(ROLLOUT, 10, 80), annotation(PREFILL, 20, 20),
              annotation(DECODE, 50, 10), annotation(DECODE, 60, 20),
              annotation("other/range", 12, 5)]
    rep = report_of(tmp_path, events)
    # self = own duration minus directly nested stage ranges (in microseconds -> ms)
    assert row(rep, STEP).self_ms == pytest.approx((100 - 80) / 1e3)
    assert row(rep, ROLLOUT).self_ms == pytest.approx((80 - 20 - 10 - 20) / 1e3)
    assert row(rep, PREFILL).self_ms == pytest.approx(20 / 1e3)
    assert row(rep, DECODE).count == 2
    assert row(rep, DECODE).cpu_ms.total == pytest.approx(30 / 1e3)
    assert [r.name for r in rep.stages] == [STEP, ROLLOUT, PREFILL, DECODE]  # contract order
    # ranges on another thread are not nested in the step (self time is per thread)
    rep2 = report_of(tmp_path, [annotation(STEP, 0, 100), annotation(BACKWARD, 10, 50, tid=2)],
                     name="t2.json")
    assert row(rep2, STEP).self_ms == pytest.approx(0.1)


def test_empty_prefix_takes_foreign_ranges(tmp_path):
    rep = report_of(tmp_path, [annotation("fwd", 0, 10), annotation("bwd", 10, 30)], prefix="")
    assert {r.name: r.count for r in rep.stages} == {"bwd": 1, "fwd": 1}


def test_gpu_projection_across_threads_and_driver_api(tmp_path):
    events = [
        annotation(STEP, 0, 100), annotation(PREFILL, 10, 30),
        launch(15, 1), gpu_op(100, 10, 1),                    # in prefill, main thread
        launch(20, 2, tid=9, driver=True), gpu_op(105, 15, 2),  # autograd thread, driver API
        launch(60, 3), gpu_op(130, 10, 3, cat="gpu_memcpy"),  # in step only
        launch(70, 4, pid=2), gpu_op(200, 50, 4),              # another process: never counted
        launch(150, 5), gpu_op(300, 10, 5),                    # launched after the step
        {"ph": "X", "cat": "gpu_user_annotation", "name": STEP, "pid": 0, "tid": 7, "ts": 100,
         "dur": 1, "args": {}},
    ]
    rep = report_of(tmp_path, events)
    prefill, step = row(rep, PREFILL), row(rep, STEP)
    assert prefill.gpu_ms.total == pytest.approx(20 / 1e3)      # union of [100,110] and [105,120]
    assert prefill.gpu_span_ms == pytest.approx(20 / 1e3)
    assert step.gpu_ms.total == pytest.approx(30 / 1e3)         # + [130,140]
    assert step.gpu_span_ms == pytest.approx(40 / 1e3)          # 100 .. 140


def test_cpu_trace_has_null_gpu(tmp_path):
    rep = report_of(tmp_path, [annotation(STEP, 0, 10)])
    assert row(rep, STEP).gpu_ms is None and row(rep, STEP).gpu_span_ms is None
    assert rep.to_dict()["stages"][0]["gpu_ms"] is None


def test_stage_without_launches_gets_zero_gpu_time(tmp_path):
    rep = report_of(tmp_path, [annotation(STEP, 0, 10), annotation(PREFILL, 20, 5),
                               launch(1, 1), gpu_op(3, 4, 1)])
    assert row(rep, PREFILL).gpu_ms.total == 0.0


@pytest.mark.parametrize("starts,ends,expected", [
    ([0], [10], 10), ([0, 5], [10, 20], 20), ([0, 30], [10, 40], 20), ([5, 0, 2], [6, 10, 3], 10),
    ([], [], 0),
])
def test_union_length(starts, ends, expected):
    from traces.compute import union_length
    assert union_length(np.array(starts, float), np.array(ends, float)) == expected


def test_memory_window_peaks(tmp_path):
    mib = 1 << 20
    events = [annotation(STEP, 100, 100), annotation(PREFILL, 120, 20),
              memory(50, 10 * mib, 40 * mib),       # carried into both windows
              memory(125, 30 * mib, 64 * mib),      # inside prefill
              memory(150, 12 * mib, 64 * mib),
              memory(250, 99 * mib, 99 * mib),      # after the step
              memory(130, 500 * mib, 0, device_type=0, device_id=-1)]  # CPU sample: other device
    rep = report_of(tmp_path, events)
    assert row(rep, PREFILL).peak_allocated_mib == 30 and row(rep, PREFILL).peak_reserved_mib == 64
    assert row(rep, STEP).peak_allocated_mib == 30
    quiet = report_of(tmp_path, [annotation(STEP, 100, 10), memory(50, 10 * mib)], name="q.json")
    assert row(quiet, STEP).peak_allocated_mib == 10   # no sample inside: the level carried in
    none = report_of(tmp_path, [annotation(STEP, 100, 10)], name="n.json")
    assert row(none, STEP).peak_allocated_mib is None


def test_ranks_from_metadata_filename_and_index(tmp_path):
    a = write_events(str(tmp_path / "x.json"), [annotation(STEP, 0, 10)], rank=3)
    b = write_events(str(tmp_path / "rank5_trace.json"), [annotation(STEP, 0, 20)])
    c = write_events(str(tmp_path / "zzz.json"), [annotation(STEP, 0, 40)])
    rep = build_report(load([a, b, c]), S.PREFIX)
    assert rep.ranks == [2, 3, 5]  # c is the third input (index 2)
    assert rep.straggler[STEP] == 2
    assert rep.rank_spread[STEP]["cpu_total_ms"] == {"min": 0.01, "median": 0.02, "max": 0.04}
    assert {k: v[0].cpu_ms.total for k, v in rep.per_rank.items()} == {2: 0.04, 3: 0.01, 5: 0.02}


def test_windows_of_one_rank_merge_and_duplicates_are_reported(tmp_path):
    w1 = write_events(str(tmp_path / "w1.json"), [annotation(STEP, 0, 10)], rank=0)
    w2 = write_events(str(tmp_path / "w2.json"), [annotation(STEP, 100, 30)], rank=0)
    dup = write_events(str(tmp_path / "w1_copy.json"), [annotation(STEP, 0, 10)], rank=0,
                       compress=True)
    loaded = load([w1, w2, dup])
    rep = build_report(loaded, S.PREFIX)
    assert rep.ranks == [0] and row(rep, STEP).count == 2
    assert any("w1_copy.json" in w and "w1.json" in w and "counted once" in w for w in rep.warnings)


@pytest.mark.parametrize("values", [[1.0], [1.0, 2.0, 3.0, 4.0], [5.0, 1.0, 9.0, 2.0, 7.0, 3.0]])
@pytest.mark.parametrize("q", [0.0, 0.5, 0.9, 1.0])
def test_percentile_matches_numpy(values, q):
    assert percentile(sorted(values), q) == pytest.approx(float(np.percentile(values, 100 * q)))


def test_stats_and_row_validation():
    s = Stats.of([3.0, 1.0, 2.0])
    assert (s.total, s.mean, s.max) == (6.0, 2.0, 3.0)
    with pytest.raises(ValueError, match="values_ms"):
        Stats.of([])
    with pytest.raises(ValueError, match="share"):
        StageRow.from_samples("x", [1.0], share=1.5)
    with pytest.raises(ValueError, match="q must be"):
        percentile([1.0], 2.0)


def test_share_of_step_and_of_span(tmp_path):
    rep = report_of(tmp_path, [annotation(STEP, 0, 100), annotation(PREFILL, 10, 25),
                               annotation(STEP, 200, 100), annotation(PREFILL, 210, 15),
                               annotation(PREFILL, 400, 50)])  # outside any step
    assert row(rep, STEP).share == 1.0
    assert row(rep, PREFILL).share == pytest.approx(40 / 200)
    no_step = report_of(tmp_path, [annotation(PREFILL, 0, 10), annotation(DECODE, 30, 10)],
                        name="ns.json")
    assert row(no_step, PREFILL).share == pytest.approx(10 / 40)  # of the trace span 0..40


def test_by_step_assigns_kth_step_range(tmp_path):
    events = [annotation(STEP, 0, 100), annotation(PREFILL, 10, 20), annotation(DECODE, 40, 5),
              annotation(STEP, 200, 100), annotation(DECODE, 210, 7), annotation(DECODE, 220, 9),
              annotation(BACKWARD, 250, 10, tid=2)]
    rep = report_of(tmp_path, events)
    steps = {k: {r.name: (r.count, r.cpu_ms.total) for r in rows} for k, rows in rep.per_step.items()}
    assert steps[0] == {STEP: (1, 0.1), PREFILL: (1, 0.02), DECODE: (1, 0.005)}
    assert steps[1][DECODE] == (2, pytest.approx(0.016)) and steps[1][BACKWARD] == (1, 0.01)
    assert rep.per_step[1][0].step == 1


def test_diff_rows():
    before = [StageRow.from_samples(STEP, [10.0, 10.0], gpu_ms=[4.0]),
              StageRow.from_samples(PREFILL, [5.0])]
    after = [StageRow.from_samples(STEP, [15.0], gpu_ms=[2.0]), StageRow.from_samples(DECODE, [1.0])]
    d = {x["name"]: x for x in diff_rows(before, after)}
    assert d[STEP]["cpu_total_ms"] == {"before": 20.0, "after": 15.0, "change": -5.0,
                                       "relative": -0.25}
    assert d[STEP]["gpu_total_ms"]["relative"] == -0.5
    assert d[DECODE]["cpu_total_ms"]["before"] is None and d[DECODE]["gpu_total_ms"] is None
    assert d[PREFILL]["cpu_total_ms"]["after"] is None

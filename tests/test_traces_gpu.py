"""GPU-aware figures on small hand-built traces with known answers: the headline (busy and where the
idle time went), GPU share, launches, sync waits and the verdict per stage (CUDA-graph decode
included), top kernels, comm vs compute (NCCL), the stage tree and the step index."""

import json

import numpy as np
import pytest

from instrumentation import stages as S
from traces import intervals
from traces.cli import main
from traces.load import load
from traces.report import build_report
from traces.synth import annotation, gpu_op, launch, profiler_step, sync, write_events

STEP, ROLLOUT, PREFILL, DECODE, OPT, BACKWARD = (
    S.range_name(s) for s in (S.STEP, S.ROLLOUT, S.PREFILL, S.DECODE, S.OPTIMIZER_STEP, S.BACKWARD))


def graph_step_events(corr_base: int = 0, step: int = 5) -> list[dict]:
    """One OPSD-like step (times in us), hand-checked below:

    - step [0, 1000] inside ``ProfilerStep#<step>``; rollout [10, 610];
    - prefill [20, 220]: 17 launches at 30, 40, .., 190, each a 2 us kernel 5 us later (eager,
      host-bound);
    - decode: 4 short ranges [220 + 5k, 223 + 5k], each launching one CUDA graph (one launch, three
      14 us kernels at 300 + 60k + 15j, j = 0..2): the graphs run long after their ranges;
    - the host waits in ``cudaStreamSynchronize`` [240, 540] inside rollout (for the graphs);
    - optimizer_step [620, 990]: 71 launches at 625, 630, .., 975, each a 1 us kernel 3 us later.
    """
    c = corr_base
    ev = [profiler_step(step, 0, 1000), annotation(STEP, 0, 1000), annotation(ROLLOUT, 10, 600),
          annotation(PREFILL, 20, 200)]
    for t in range(30, 200, 10):
        c += 1
        ev += [launch(t, c), gpu_op(t + 5, 2, c, name="prefill_gemm")]
    for k in range(4):
        c += 1
        t0 = 220 + 5 * k
        ev += [annotation(DECODE, t0, 3), launch(t0 + 1, c)]
        ev += [gpu_op(300 + 60 * k + 15 * j, 14, c, name=f"nvjet_{j}") for j in range(3)]
    ev += [sync(240, 300, correlation=corr_base + 900), annotation(OPT, 620, 370)]
    for t in range(625, 980, 5):
        c += 1
        ev += [launch(t, c), gpu_op(t + 3, 1, c, name="multi_tensor_apply_kernel")]
    return ev


#: The answers, worked out by hand from the events (us):
#: busy = prefill 17 * 2 + decode 4 * 42 + optimizer 71 * 1 = 273;
#: idle 727 = host_launch 595 (35 before the first kernel, 16 * 8 between prefill kernels, 43 + 88
#: before the first decode / optimizer kernel outside the sync, 70 * 4 between optimizer kernels, 21
#: at the end) + host_sync 76 (the parts of those two gaps inside the sync: 60 and 16) + other 56
#: (graph kernels already queued: 8 * 1 inside graphs, 3 * 16 between graphs).
BUSY_US, HOST_LAUNCH_US, HOST_SYNC_US, OTHER_US = 273.0, 595.0, 76.0, 56.0


def report_of(tmp_path, events, name="rank0.pt.trace.json", kernels=0, **kw):
    path = write_events(str(tmp_path / name), events, **kw)
    loaded = load([path])
    assert not loaded.errors
    return build_report(loaded, S.PREFIX, kernels)


def rows(report):
    return {r.name: r for r in report.stages}


def test_headline_busy_and_idle_split(tmp_path):
    head = report_of(tmp_path, graph_step_events(), rank=0).headline
    assert head.stage == STEP and head.wall_ms == pytest.approx(1.0)
    assert head.gpu_busy_ms == pytest.approx(BUSY_US / 1e3)
    assert head.gpu_busy_pct == pytest.approx(27.3)
    assert head.idle.host_launch_ms == pytest.approx(HOST_LAUNCH_US / 1e3)
    assert head.idle.host_sync_ms == pytest.approx(HOST_SYNC_US / 1e3)
    assert head.idle.other_ms == pytest.approx(OTHER_US / 1e3)
    parts = head.gpu_busy_ms + head.idle.host_launch_ms + head.idle.host_sync_ms + head.idle.other_ms
    assert parts == pytest.approx(head.wall_ms)  # busy + idle = wall


def test_bound_bands():
    """Issue 33: host below 40% GPU busy, gpu above 60%, mixed between; sync when waits fill half the window."""
    from traces.figures import bound
    assert [bound(b, 0, 100) for b in (0, 39.9, 40, 50.7, 60, 60.1, 100)] == \
        ["host", "host", "mixed", "mixed", "mixed", "gpu", "gpu"]
    assert bound(30, 50, 100) == "sync" and bound(61, 50, 100) == "gpu" and bound(10, 49, 100) == "host"
    assert bound(0, 0, 0) == "host"


def test_per_stage_gpu_share_launches_sync_and_bound(tmp_path):
    r = rows(report_of(tmp_path, graph_step_events()))
    expected = {  # gpu busy us, launches, sync us charged, bound
        STEP: (273, 92, 300, "host"),      # GPU busy 27% of the step
        ROLLOUT: (202, 21, 300, "sync"),   # the host waits 300 of its 600 us
        PREFILL: (34, 17, 0, "host"),      # 200 us of host for 34 us of GPU
        DECODE: (168, 4, 300, "mixed"),    # window 220..524: 168 of 304 us busy (55%: neither 40% nor 60%)
        OPT: (71, 71, 0, "host"),
    }
    for name, (busy, launches, sync_us, verdict) in expected.items():
        g = r[name].gpu
        assert r[name].gpu_ms.total == pytest.approx(busy / 1e3), name
        assert g.share == pytest.approx(busy / 273), name
        assert (g.launches, g.bound) == (launches, verdict), name
        assert g.sync_ms == pytest.approx(sync_us / 1e3), name
    assert r[ROLLOUT].gpu.wait_ms == pytest.approx(0.3) and r[DECODE].gpu.wait_ms == 0.0
    assert r[DECODE].share == pytest.approx(0.012)  # the CPU share hides the decode


def test_sync_wait_is_split_over_the_work_it_waited_for(tmp_path):
    ev = [annotation(STEP, 0, 200), annotation(PREFILL, 10, 10), annotation(DECODE, 20, 10),
          launch(12, 1), gpu_op(40, 30, 1), launch(22, 2), gpu_op(70, 90, 2), sync(40, 120),
          annotation(OPT, 170, 20), sync(175, 10)]  # no GPU work runs during the second wait
    r = rows(report_of(tmp_path, ev))
    assert r[PREFILL].gpu.sync_ms == pytest.approx(0.120 * 30 / 120)
    assert r[DECODE].gpu.sync_ms == pytest.approx(0.120 * 90 / 120)
    assert r[OPT].gpu.sync_ms == pytest.approx(0.010)  # charged to the stage that called it
    assert r[STEP].gpu.sync_ms == pytest.approx(0.130)  # inclusive, like GPU time


def test_top_kernels_and_slowest_call(tmp_path):
    r = rows(report_of(tmp_path, graph_step_events(), kernels=2))
    assert [(k.name, k.count) for k in r[STEP].kernels] == [("multi_tensor_apply_kernel", 71),
                                                             ("nvjet_0", 4)]
    assert r[DECODE].kernels[0].gpu_ms == pytest.approx(4 * 0.014)
    slow = r[DECODE].slowest  # the last graph ends last: window 235 .. 524
    assert (slow.ts_us, slow.window_ms, slow.rank) == (235.0, pytest.approx(0.289), 0)
    assert slow.offset_ms == pytest.approx(0.235)
    assert report_of(tmp_path, graph_step_events(), name="b.json").stages[0].kernels is None


def test_each_stages_kernels_are_listed_once(tmp_path, monkeypatch):
    """With ``kernels`` > 0 the rows' top kernels, the per-rank rows' and ``stage_kernels`` (every kernel, what
    ``--diff`` compares) come from one scan of each stage's kernels: one ``top_kernels`` call a stage, not three."""
    from collections import Counter

    import traces.report
    from tests.conftest import counter
    calls = Counter()
    monkeypatch.setattr(traces.report, "top_kernels", counter(calls)("top", traces.report.top_kernels))
    rep = report_of(tmp_path, graph_step_events(), kernels=2)
    assert calls["top"] == len(rep.stages) == len(rep.stage_kernels) == 5
    for row in rep.stages + rep.per_rank[0]:
        assert row.kernels == rep.stage_kernels[row.name][:2], row.name
    assert [k.name for k in rep.stage_kernels[STEP]][:2] == ["multi_tensor_apply_kernel", "nvjet_0"]


def test_comm_vs_compute_with_nccl_kernels_on_their_stream(tmp_path):
    ev = [annotation(STEP, 0, 1000), annotation(BACKWARD, 10, 100),
          launch(20, 1), gpu_op(100, 200, 1, name="ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_nn",
                                stream=7),
          launch(30, 2), gpu_op(200, 200, 2, name="ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL("
                                "ncclDevKernelArgsStorage<4096ul>)", stream=29),
          launch(40, 3), gpu_op(450, 50, 3, name="ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)",
                                stream=29),
          launch(50, 4), gpu_op(520, 10, 4, cat="gpu_memcpy", stream=7)]
    r = rows(report_of(tmp_path, ev))
    g = r[BACKWARD].gpu
    assert g.comm_ms == pytest.approx(0.250)            # 200..400 and 450..500
    assert g.comm_overlap == pytest.approx(100 / 250)   # gemm 100..300 covers 200..300 of it
    assert rows(report_of(tmp_path, graph_step_events(), name="c.json"))[STEP].gpu.comm_overlap is None


def test_stage_tree_across_threads(tmp_path):
    ev = [annotation(STEP, 0, 100), annotation(ROLLOUT, 5, 40), annotation(PREFILL, 10, 5),
          annotation(BACKWARD, 60, 30, tid=2), annotation(OPT, 92, 5)]
    rep = report_of(tmp_path, ev)
    assert [(r.name, r.depth, r.parent) for r in rep.stages] == [
        (STEP, 0, None), (ROLLOUT, 1, STEP), (PREFILL, 2, ROLLOUT), (BACKWARD, 1, STEP), (OPT, 1, STEP)]


@pytest.mark.parametrize("marks,expected", [
    ([profiler_step(7, 0, 100), profiler_step(8, 100, 100)], [7, 8]),  # torch.profiler's step numbers
    ([], [0, 1]),                                                      # none: 0, 1, ... in time order
    ([profiler_step(7, 0, 300)], [0, 1]),                             # ambiguous: both in one mark
])
def test_step_index_is_the_training_step(tmp_path, marks, expected):
    ev = marks + [annotation(STEP, 10, 80), annotation(PREFILL, 20, 5),
                  annotation(STEP, 110, 80), annotation(PREFILL, 120, 7)]
    rep = report_of(tmp_path, ev)
    assert sorted(rep.per_step) == expected
    assert rows_of(rep.per_step[expected[1]])[PREFILL].cpu_ms.total == pytest.approx(0.007)


def rows_of(rs):
    return {r.name: r for r in rs}


def test_cpu_trace_has_null_gpu_figures_and_headline(tmp_path):
    rep = report_of(tmp_path, [annotation(STEP, 0, 10), annotation(PREFILL, 2, 3)])
    assert rep.headline.gpu_busy_ms is None and rep.headline.idle is None
    assert rows(rep)[PREFILL].gpu.bound is None and rows(rep)[PREFILL].gpu.launches is None
    doc = rep.to_dict()
    assert doc["headline"]["gpu_busy_pct"] is None and doc["stages"][1]["gpu_share"] is None


def test_headline_root_without_step_range_is_the_outermost_stage(tmp_path):
    rep = report_of(tmp_path, [annotation(ROLLOUT, 0, 50), annotation(PREFILL, 5, 10),
                               annotation(OPT, 60, 10), launch(6, 1), gpu_op(8, 20, 1)])
    assert rep.headline.stage == ROLLOUT and rep.headline.gpu_busy_ms == pytest.approx(0.02)
    assert rows(rep)[PREFILL].gpu.share == pytest.approx(1.0)


def test_json_by_rank_headlines_and_merged_total(tmp_path, capsys):
    for rank in (0, 1):
        write_events(str(tmp_path / f"rank{rank}.pt.trace.json"), graph_step_events(), rank=rank)
    assert main([str(tmp_path), "--format", "json", "--by-rank", "--kernels", "1"]) == 0
    doc = json.loads(capsys.readouterr().out)
    for rank in ("0", "1"):
        head = doc["per_rank"][rank]["headline"]
        assert head["gpu_busy_ms"] == pytest.approx(0.273) and head["idle"]["other_ms"] == pytest.approx(0.056)
    assert doc["headline"]["wall_ms"] == pytest.approx(2.0) and doc["headline"]["gpu_busy_pct"] == pytest.approx(27.3)
    step = next(s for s in doc["stages"] if s["name"] == STEP)
    assert step["kernels"] == [{"name": "multi_tensor_apply_kernel", "count": 142, "gpu_ms": pytest.approx(0.142)}]


@pytest.mark.parametrize("starts,ends,lo,hi,gaps,covered", [
    ([1, 2, 8], [3, 5, 9], 0, 10, [(0, 1), (5, 8), (9, 10)], 5),
    ([], [], 0, 4, [(0, 4)], 0),
    ([-5, 3], [20, 4], 0, 10, [], 10),
])
def test_interval_helpers(starts, ends, lo, hi, gaps, covered):
    s, e = np.array(starts, float), np.array(ends, float)
    gs, ge = intervals.gaps(s, e, lo, hi)
    assert list(zip(gs.tolist(), ge.tolist())) == gaps
    assert intervals.covered_length(s, e, lo, hi) == covered
    assert intervals.intersection_length((np.array([0.0, 10.0]), np.array([5.0, 20.0])),
                                         (np.array([3.0]), np.array([12.0]))) == 4.0

"""The findings block (issue 33, first part): derived from the stage rows' figures, ranked by recoverable time."""

from __future__ import annotations

import json

import pytest

from instrumentation import stages as S
from tests.test_traces_gpu import graph_step_events, report_of
from traces.cli import main
from traces.findings import MAX_FINDINGS, findings, format_findings
from traces.records import GpuFigures, StageRow, Stats
from traces.synth import annotation, sync, write_events

PREFILL, OPT = S.range_name(S.PREFILL), S.range_name(S.OPTIMIZER_STEP)


def test_the_hand_built_step_names_its_host_bound_stages(tmp_path):
    """The step of tests/test_traces_gpu.py: the optimizer step (370 us of host, 71 launches of 1 us kernels) and
    the prefill (200 us, 17 launches of 2 us): host-bound, largest first; the GPU-bound decode and the parents
    (step, rollout) are not findings."""
    items = findings(report_of(tmp_path, graph_step_events()).stages)
    assert [(f.stage, f.kind) for f in items] == [(OPT, "host-bound"), (PREFILL, "host-bound")]
    assert items[0].recoverable_ms == pytest.approx(0.370 - 0.071)
    assert items[1].recoverable_ms == pytest.approx(0.200 - 0.034)
    assert "71 launches" in items[0].evidence and "fewer, larger launches" in items[0].action


def _row(name, cpu_ms, gpu_ms, bound, launches=0, wait_ms=0.0, parent="opsd/step"):
    return StageRow(name, 1, Stats.of([cpu_ms]), Stats.of([gpu_ms]), parent=parent,
                    gpu=GpuFigures(launches=launches, wait_ms=wait_ms, bound=bound))


def test_findings_come_from_figures_not_names():
    """Any stage name; a sync-bound stage gives its wait; few launches point at host work between them; small items
    (under 1% of the step) and GPU-bound stages are left out; at most MAX_FINDINGS."""
    rows = [_row("opsd/step", 1000.0, 500.0, "mixed", parent=None),
            _row("my/own_stage", 300.0, 10.0, "host", launches=20),
            _row("my/waiting", 200.0, 20.0, "sync", wait_ms=150.0),
            _row("my/tiny", 5.0, 1.0, "host", launches=2),
            _row("my/gpu", 400.0, 390.0, "gpu", launches=4)]
    rows += [_row(f"my/more{i}", 50.0 + i, 1.0, "host", launches=1000) for i in range(6)]
    items = findings(rows)
    assert len(items) == MAX_FINDINGS and items[0].stage == "my/own_stage" and items[1].stage == "my/waiting"
    assert items[1].kind == "sync" and items[1].recoverable_ms == 150.0
    assert "host works between launches" in items[0].action
    assert {"my/tiny", "my/gpu", "opsd/step"}.isdisjoint(f.stage for f in items)
    text = format_findings(items)
    assert text.startswith("findings (") and "  1. my/own_stage (host-bound): up to 290.0 ms/step" in text
    assert format_findings([]) == ""


def test_the_report_shows_findings_on_the_first_screen(tmp_path, capsys):
    path = write_events(str(tmp_path / "rank0.pt.trace.json"), graph_step_events(), rank=0)
    assert main([path]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].startswith("findings (") and lines[3].startswith(f"  1. {OPT} (host-bound)")
    assert main([path, "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [f["stage"] for f in doc["findings"]] == [OPT, PREFILL]
    quiet = write_events(str(tmp_path / "q.pt.trace.json"), [annotation(S.range_name(S.STEP), 0, 10)], rank=0)
    assert main([quiet]) == 0 and "findings" not in capsys.readouterr().out  # a CPU trace: nothing to find


# --- issue 33, items 2 and 3: GPU-bound stages against their roofline, slow operators, all ranked together ---

from traces.records import KernelRow, SlowOperator, StepSpread  # noqa: E402
from traces.report import build_report  # noqa: E402
from traces.load import load  # noqa: E402
from traces.synth import cpu_op, gpu_op, launch, profiler_step  # noqa: E402
from traces.work import WorkFigures  # noqa: E402

TEACHER, BACKWARD = S.range_name(S.TEACHER_FORWARD), S.range_name(S.BACKWARD)


def _gpu_row(name, gpu_ms, roofline_ms, limit, bound):
    spread = StepSpread.of([gpu_ms + 1.0], [gpu_ms])
    return StageRow(name, 1, Stats.of([gpu_ms + 1.0]), Stats.of([gpu_ms]), parent="opsd/step", per_step=spread,
                    gpu=GpuFigures(launches=10, bound=bound),
                    work=WorkFigures(1e12, 1e9, roofline_ms, gpu_ms / roofline_ms, limit))


@pytest.mark.parametrize("limit,gemm_name,action", [
    ("memory", "sm90_xmma_gemm_bf16", "read the weights fewer times"),
    ("compute", "vectorized_elementwise_kernel", "fuse the elementwise"),   # matmuls a small share: fuse the rest
    ("compute", "nvjet_tst_128x256_64x4", "its matmuls run far from peak"),
])
def test_a_gpu_bound_stage_is_a_finding_by_its_distance_from_the_roofline(limit, gemm_name, action):
    """Recoverable = GPU ms/step - roofline ms/step; the evidence names x roofline, the limit and the kernels that
    hold it; the action follows the limit and the matmuls' share (kernel names, never the stage's)."""
    rows = [_row("opsd/step", 100.0, 90.0, "gpu", parent=None), _gpu_row("my/pass", 40.0, 10.0, limit, limit)]
    kernels = {"my/pass": (KernelRow(gemm_name, 10, 30.0), KernelRow("other_kernel", 5, 10.0))}
    (item,) = findings(rows, kernels=kernels)
    assert (item.stage, item.kind, item.recoverable_ms) == ("my/pass", f"{limit}-bound", 30.0)
    assert f"4.0x its {limit} roofline of 10.00 ms" in item.evidence and "75%" in item.evidence
    assert action in item.action
    assert findings([rows[0], _gpu_row("my/pass", 9.0, 10.0, limit, limit)]) == []  # under its roofline: nothing


def test_every_kind_of_finding_is_ranked_by_recoverable_time():
    """Host, sync, distance from the roofline and a slow operator in one list, largest first."""
    rows = [_row("opsd/step", 1000.0, 500.0, "mixed", parent=None),
            _row("a/host", 100.0, 10.0, "host", launches=1000),                       # 90
            _row("b/sync", 200.0, 20.0, "sync", wait_ms=150.0),                       # 150
            _gpu_row("c/gpu", 70.0, 10.0, "compute", "compute")]                      # 60
    slow = SlowOperator("aten::_cudnn_attention_forward", "d/pass", 108, 36, 29.0, 0.12, 0.12, 2.0, 1040.0, "median")
    items = findings(rows, operators=[slow])
    assert [(f.stage, f.kind) for f in items] == [("d/pass", "slow operator"), ("b/sync", "sync"),
                                                 ("a/host", "host-bound"), ("c/gpu", "compute-bound")]
    head, evidence, action = items[0].lines()
    assert head == "aten::_cudnn_attention_forward in d/pass (slow operator): up to 1,040.0 ms/step"
    assert "36 of 108 calls at 29.0 ms of host each, against a median of 0.120 ms" in evidence
    assert "CUDA_CACHE_PATH" in action and "varlen" in action and "When the first steps are slow" in action
    assert items[0].to_dict()["operator"] == "aten::_cudnn_attention_forward"


def _cold_step(slow_ms, fast_calls, step=0, t0=0.0, corr=0):
    """A step whose stage calls ``aten::sdpa`` > ``aten::attn`` (each one launch of a 0.12 ms kernel launched at the
    end of the call): ``slow_ms`` calls of the given host ms, then ``fast_calls`` calls of 0.1 ms."""
    ev = [profiler_step(step, t0, 200_000), annotation(S.range_name(S.STEP), t0 + 1, 199_000),
          annotation(TEACHER, t0 + 10, 190_000)]
    t = t0 + 100.0
    for ms in list(slow_ms) + [0.1] * fast_calls:
        corr += 1
        dur = ms * 1e3
        ev += [cpu_op("aten::sdpa", t, dur + 2), cpu_op("aten::attn", t + 1, dur),
               launch(t + dur - 1, corr), gpu_op(t + dur + 1, 120, corr, name="cudnn_attn_kernel")]
        t += dur + 200
    return ev


def _report(tmp_path, events):
    path = write_events(str(tmp_path / "rank0.pt.trace.json"), events, rank=0)
    loaded = load([path])
    assert not loaded.errors
    return build_report(loaded, S.PREFIX)


def test_an_operator_far_above_its_median_is_named_with_its_stage(tmp_path):
    """Three 30 ms calls among nine of 0.1 ms (kernels built for new shapes): the inner operator is named, not the
    one around it; its excess is the host time above its median while the GPU idled."""
    rep = _report(tmp_path, _cold_step([30.0] * 3, 9))
    (op,) = rep.operators
    assert (op.name, op.stage, op.calls, op.slow_calls, op.rule) == ("aten::attn", TEACHER, 12, 3, "median")
    assert op.host_ms == pytest.approx(30.0) and op.median_ms == pytest.approx(0.1, rel=0.05)
    assert op.excess_ms == pytest.approx(3 * (30.0 - op.median_ms), rel=1e-3)
    (item,) = [f for f in findings(rep.stages, operators=rep.operators) if f.kind == "slow operator"]
    assert item.operator == "aten::attn" and item.stage == TEACHER and item.recoverable_ms > 80


def test_an_operator_whose_every_call_is_slow_is_named_by_its_gpu_time(tmp_path, capsys):
    """Every call slow (its median slow too): 30 ms of host against 0.12 ms of GPU work each."""
    rep = _report(tmp_path, _cold_step([30.0, 31.0, 29.0], 0))
    (op,) = rep.operators
    assert (op.name, op.rule, op.slow_calls) == ("aten::attn", "gpu", 3)
    assert op.gpu_ms == pytest.approx(0.12) and op.excess_ms == pytest.approx(90.0 - 3 * 0.12, rel=1e-3)
    path = write_events(str(tmp_path / "cold.pt.trace.json"), _cold_step([30.0, 31.0, 29.0], 0), rank=0)
    assert main([path]) == 0
    out = capsys.readouterr().out
    assert f". aten::attn in {TEACHER} (slow operator): up to 89.6 ms/step" in out  # beside the stage's own finding
    assert main([path, "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["slow_operators"][0]["name"] == "aten::attn"
    assert [f["operator"] for f in doc["findings"]] == [None, "aten::attn"]


def test_launch_bound_and_waiting_operators_are_not_slow_operators(tmp_path):
    """An operator that launches 100 kernels in 5 ms (launching is its work), and one that waits 20 ms in a sync
    while the GPU runs queued work, are not named."""
    ev = [annotation(S.range_name(S.STEP), 0, 100_000), annotation(BACKWARD, 10, 90_000),
          cpu_op("aten::many", 100, 5000)]
    ev += [x for k in range(100) for x in (launch(150 + 48 * k, k + 1), gpu_op(160 + 48 * k, 10, k + 1))]
    ev += [launch(6000, 500), gpu_op(6010, 21_000, 500, name="long_gemm"), cpu_op("aten::item", 6100, 20_500),
           sync(6200, 20_300)]
    assert _report(tmp_path, ev).operators == []


def test_old_traces_without_cpu_ops_or_work_have_no_new_findings(tmp_path):
    """The hand-built step (no cpu_op, no work sidecar): no slow operator, no roofline finding, same findings."""
    rep = report_of(tmp_path, graph_step_events())
    assert rep.operators == [] and rep.stage_kernels == {}
    assert [f.kind for f in findings(rep.stages, kernels=rep.stage_kernels, operators=rep.operators)] == \
        ["host-bound", "host-bound"]

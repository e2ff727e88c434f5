"""Issue 33, item 2: per stage the GPU idle time, per-step mean and median in the overview, and the verdict bands
refined by work (memory, compute) and by host operators (idle); old traces keep every other column."""

import json

import pytest

from instrumentation import stages as S
from tests.test_traces_gpu import graph_step_events, report_of, rows
from traces.cli import main
from traces.format import format_overview
from traces.synth import annotation, cpu_op, gpu_op, launch, profiler_step, write_events

STEP, ROLLOUT, PREFILL, DECODE, OPT, BACKWARD = (
    S.range_name(s) for s in (S.STEP, S.ROLLOUT, S.PREFILL, S.DECODE, S.OPTIMIZER_STEP, S.BACKWARD))


def test_idle_ms_is_the_gpu_idle_time_inside_each_stage(tmp_path):
    """The hand-built step of tests/test_traces_gpu.py (us): the step's idle is the headline's (1000 - 273 busy);
    prefill 200 - 17 * 2; the decode ranges launch graphs that run after them: idle all 4 * 3 us; the rollout
    600 - 34 - 168; the optimizer 370 - 71."""
    rep = report_of(tmp_path, graph_step_events())
    r = rows(rep)
    head = rep.headline.idle
    assert r[STEP].gpu.idle_ms == pytest.approx(head.host_launch_ms + head.host_sync_ms + head.other_ms)
    expected = {STEP: 727, ROLLOUT: 398, PREFILL: 166, DECODE: 12, OPT: 299}
    for name, idle_us in expected.items():
        assert r[name].gpu.idle_ms == pytest.approx(idle_us / 1e3), name
        assert r[name].per_step.idle_mean_ms == pytest.approx(idle_us / 1e3), name
    assert r[PREFILL].gpu.host_op_ms is None  # no cpu_op events: no host-operator figure


def _steps(prefill_us=(100, 200, 600)):
    """Three steps; the prefill launches one 10 us kernel per step."""
    ev = []
    for k, dur in enumerate(prefill_us):
        t = 10_000.0 * k
        ev += [profiler_step(k, t, 9000), annotation(STEP, t + 1, 8000), annotation(PREFILL, t + 10, dur),
               launch(t + 20, k + 1), gpu_op(t + 30, 10, k + 1)]
    return ev


def test_the_overview_shows_per_step_mean_and_median_not_totals(tmp_path, capsys):
    """A window of three steps: prefill 0.1, 0.2 and 0.6 ms prints mean 0.300 and p50 0.200, not the 0.900 total;
    launches and GPU time per step too."""
    path = write_events(str(tmp_path / "rank0.pt.trace.json"), _steps(), rank=0)
    assert main([path]) == 0
    lines = capsys.readouterr().out.splitlines()
    title = next(i for i, line in enumerate(lines) if line.startswith("stages ("))
    assert "mean over 3 recorded steps; cpu/gpu p50: the median step" in lines[title]
    header = lines[title + 1].split()
    assert header[:5] == ["stage", "count", "cpu", "ms", "cpu"] and "p50" in header
    prefill = next(line for line in lines if line.strip().startswith(PREFILL)).split()
    assert prefill[1:5] == ["3", "0.300", "0.200", "3.8%"]  # count in all, cpu ms/step, cpu p50, share
    assert prefill[5:7] == ["0.010", "0.010"] and prefill[8] == "0.290" and prefill[9] == "1"  # gpu, p50, idle, launches
    assert "0.900" not in " ".join(prefill)
    assert main([path, "--format", "json"]) == 0
    spread = {s["name"]: s for s in json.loads(capsys.readouterr().out)["stages"]}[PREFILL]["per_step"]
    assert (spread["cpu_mean_ms"], spread["cpu_p50_ms"]) == (pytest.approx(0.3), pytest.approx(0.2))


def test_a_trace_without_steps_keeps_totals(tmp_path):
    rep = report_of(tmp_path, [annotation(ROLLOUT, 0, 50), annotation(PREFILL, 5, 10), launch(6, 1),
                               gpu_op(8, 20, 1), annotation(PREFILL, 30, 10)])
    text = format_overview(rep.stages)
    assert text.startswith("stages (totals over the trace") and "p50" not in text
    assert next(line for line in text.splitlines() if line.startswith("  " + PREFILL)).split()[2] == "0.020"


def _work_trace(folder):
    """Two steps: backward holds a 2 ms kernel (80% of its window), the optimizer a 3 ms one (86%)."""
    ev = []
    for k, step in enumerate((1, 2)):
        t, c = 10_000.0 * k, 10 * k
        ev += [profiler_step(step, t, 9000), annotation(STEP, t + 1, 8000), annotation(BACKWARD, t + 10, 2500),
               launch(t + 20, c + 1), gpu_op(t + 30, 2000, c + 1, name="sm90_xmma_gemm_bf16"),
               annotation(OPT, t + 3000, 3500), launch(t + 3010, c + 2),
               gpu_op(t + 3020, 3000, c + 2, name="multi_tensor_apply_kernel")]
    folder.mkdir()
    path = write_events(str(folder / "rank0.1.pt.trace.json"), ev, rank=0)
    rates = {"peak_flops_s": 1e15, "copy_bytes_s": 2e12}
    lines = [{"step": s, "rank": 0, "stage": st, "rows": 4, "tokens": 256, "flops": f, "bytes": b, **rates}
             for s in (1, 2) for st, f, b in (("backward", 1e12, 1e9), ("optimizer_step", 0.0, 4e9))]
    (folder / "rank0.work.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_a_gpu_bound_stage_with_work_is_memory_or_compute_bound(tmp_path, capsys):
    """With work the gpu band says which limit: backward 1 ms of compute vs 0.5 ms of copies, the optimizer 2 ms of
    copies; findings set them against that roofline (2.0 - 1.0 and 3.0 - 2.0 ms/step)."""
    path = _work_trace(tmp_path / "run")
    assert main([path, "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    stages = {s["name"]: s for s in doc["stages"]}
    assert (stages[BACKWARD]["bound"], stages[OPT]["bound"]) == ("compute", "memory")
    found = {f["stage"]: f for f in doc["findings"]}
    assert found[BACKWARD]["kind"] == "compute-bound" and found[BACKWARD]["recoverable_ms"] == pytest.approx(1.0)
    assert "sm90_xmma_gemm_bf16 100%" in found[BACKWARD]["evidence"] and "matmuls 100%" in found[BACKWARD]["evidence"]
    assert found[OPT]["kind"] == "memory-bound" and found[OPT]["recoverable_ms"] == pytest.approx(1.0)
    (tmp_path / "run" / "rank0.work.jsonl").unlink()  # the same trace without work: plain gpu, no such finding
    assert main([path, "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {s["name"]: s["bound"] for s in doc["stages"]}[BACKWARD] == "gpu" and doc["findings"] == []


@pytest.mark.parametrize("op_us,verdict", [(100, "idle"), (800, "host"), (None, "host")])
def test_idle_when_neither_the_gpu_nor_a_host_operator_works(tmp_path, op_us, verdict):
    """A 1 ms stage with one 10 us kernel: GPU idle 99%. Host operators 10% of it: ``idle`` (Python, I/O or a wait
    the trace does not show); 80%: ``host``; a trace without cpu_op events (older ones, nsys): never ``idle``."""
    ev = [annotation(STEP, 0, 2000), annotation(OPT, 100, 1000), launch(150, 1), gpu_op(160, 10, 1)]
    if op_us is not None:
        ev.append(cpu_op("aten::add_", 120, op_us))
    r = rows(report_of(tmp_path, ev))
    assert r[OPT].gpu.bound == verdict
    assert r[OPT].gpu.host_op_ms == (None if op_us is None else pytest.approx(op_us / 1e3))

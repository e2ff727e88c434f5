"""Real torch.profiler CPU traces of a tiny model run inside the stage ranges."""

import glob
import os

import pytest

torch = pytest.importorskip("torch")

from instrumentation import stages as S  # noqa: E402
from traces.load import load  # noqa: E402
from traces.report import build_report  # noqa: E402

STEP, ROLLOUT, PREFILL, DECODE = (S.range_name(s) for s in (S.STEP, S.ROLLOUT, S.PREFILL, S.DECODE))
DATA = os.path.join(os.path.dirname(__file__), "data", "traces")
NUM_STEPS, NUM_DECODE = 2, 3


def profiled_run(on_trace_ready=None):
    from torch.profiler import ProfilerActivity, profile, record_function

    from rollout.testing import tiny_model
    model = tiny_model()
    ids = torch.randint(3, 500, (2, 8))  # ids: [B, T]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                 on_trace_ready=on_trace_ready) as prof, torch.no_grad():
        for _ in range(NUM_STEPS):
            with record_function(STEP), record_function(ROLLOUT):
                with record_function(PREFILL):
                    model(ids)
                for _ in range(NUM_DECODE):
                    with record_function(DECODE):
                        model(ids[:, :1])
    return prof


@pytest.fixture(scope="module")
def real_traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("prof")
    profiled_run(torch.profiler.tensorboard_trace_handler(str(d / "tb"), use_gzip=True))
    profiled_run().export_chrome_trace(str(d / "chrome.json"))
    return glob.glob(str(d / "tb" / "*.pt.trace.json.gz")) + [str(d / "chrome.json")]


def check(report):
    rows = {r.name: r for r in report.stages}
    per_file = len(report.sources)
    assert {n: rows[n].count for n in rows} == {STEP: NUM_STEPS * per_file,
                                                ROLLOUT: NUM_STEPS * per_file,
                                                PREFILL: NUM_STEPS * per_file,
                                                DECODE: NUM_STEPS * NUM_DECODE * per_file}
    # nesting: step = rollout + its own self time; rollout = prefill + decodes + self
    assert rows[STEP].self_ms == pytest.approx(rows[STEP].cpu_ms.total - rows[ROLLOUT].cpu_ms.total)
    assert rows[ROLLOUT].self_ms == pytest.approx(
        rows[ROLLOUT].cpu_ms.total - rows[PREFILL].cpu_ms.total - rows[DECODE].cpu_ms.total)
    assert rows[DECODE].self_ms == pytest.approx(rows[DECODE].cpu_ms.total)
    assert rows[STEP].share == 1.0 and 0 < rows[PREFILL].share < 1
    assert all(r.gpu_ms is None for r in rows.values())  # CPU-only trace
    assert rows[PREFILL].peak_allocated_mib > 0  # [memory] events of the CPU allocator
    assert rows[STEP].peak_allocated_mib >= rows[PREFILL].peak_allocated_mib
    assert sorted(report.per_step) == list(range(NUM_STEPS))


def test_fresh_profiler_traces(real_traces):
    assert len(real_traces) == 2 and real_traces[0].endswith(".gz")
    for path in real_traces:
        loaded = load([path])
        assert not loaded.errors and not loaded.warnings
        check(build_report(loaded, S.PREFIX))


def test_stored_trace_file():
    loaded = load([os.path.join(DATA, "cpu_tiny.pt.trace.json.gz")])
    assert not loaded.errors and len(loaded.files) == 1
    report = build_report(loaded, S.PREFIX)
    rows = {r.name: r for r in report.stages}
    assert {n: r.count for n, r in rows.items()} == {STEP: 2, ROLLOUT: 2, PREFILL: 2, DECODE: 4}
    assert rows[PREFILL].peak_allocated_mib > 0
    every = build_report(load([os.path.join(DATA, "cpu_tiny.pt.trace.json.gz")]), "")
    assert {r.name for r in every.stages} >= set(rows)

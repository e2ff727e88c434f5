"""scripts/trim_trace.py: one step of a trace, with everything the report needs about it."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_traces_gpu import BUSY_US, HOST_LAUNCH_US, HOST_SYNC_US, OTHER_US, graph_step_events
from traces.load import load
from traces.report import build_report
from traces.synth import annotation, gpu_op, launch, memory, write_events

ROOT = Path(__file__).resolve().parent.parent


def two_steps(tmp_path) -> str:
    """Steps 5 and 6 of one rank (the second shifted by 2000 us, its correlations by 1000), a memory
    sample before each, a flow pair, a cpu_op, and a kernel of step 6 that runs after its range."""
    events = graph_step_events(step=5)
    for e in graph_step_events(corr_base=1000, step=6):
        e = dict(e, ts=e["ts"] + 2000, args=dict(e["args"]))
        events.append(e)
    events += [memory(-5, 1 << 20), memory(1990, 3 << 20), memory(2100, 4 << 20),
               launch(2950, 1999), gpu_op(3100, 50, 1999, name="late_kernel"),
               {"ph": "s", "id": 1999, "pid": 1, "tid": 1, "ts": 2950, "cat": "ac2g", "name": "ac2g"},
               {"ph": "f", "id": 1999, "pid": 0, "tid": 7, "ts": 3100, "cat": "ac2g", "name": "ac2g", "bp": "e"},
               {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 2400, "dur": 5,
                "args": {}},
               {"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "python"}}]
    return write_events(str(tmp_path / "full.pt.trace.json"), events, rank=3)


def trim(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "trim_trace.py"), *map(str, argv)],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("step_args", [["--step", "6"], []])  # the last step is the default
def test_trimmed_step_reports_as_that_step_of_the_full_trace(tmp_path, step_args):
    full = two_steps(tmp_path)
    out = tmp_path / "rank3.step6.pt.trace.json.gz"
    proc = trim(full, out, *step_args)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("step 6 ")
    whole = build_report(load([full]), "opsd/")
    part = build_report(load([str(out)]), "opsd/")
    assert part.ranks == [3] and list(part.per_step) == [6]  # rank and step index survive
    expected = {r.name: r for r in whole.per_step[6]}
    for row in part.stages:
        e = expected[row.name]
        assert (row.count, row.cpu_ms.total, row.gpu_ms.total, row.gpu.launches, row.gpu.sync_ms) == \
               (e.count, e.cpu_ms.total, e.gpu_ms.total, e.gpu.launches, e.gpu.sync_ms)
    head = part.headline  # the late kernel runs after the step: outside its window
    assert (head.wall_ms, head.gpu_busy_ms) == (pytest.approx(1.0), pytest.approx(BUSY_US / 1e3))
    assert head.idle.to_dict() == pytest.approx({"host_launch_ms": HOST_LAUNCH_US / 1e3,
                                                 "host_sync_ms": HOST_SYNC_US / 1e3,
                                                 "other_ms": OTHER_US / 1e3})
    with gzip.open(out, "rt") as f:
        doc = json.load(f)
    names = [e["name"] for e in doc["traceEvents"]]
    assert "late_kernel" in names and names.count("ac2g") == 2 and "aten::mm" in names
    assert "ProfilerStep#6" in names and "ProfilerStep#5" not in names and "process_name" in names
    mem = [e["ts"] for e in doc["traceEvents"] if e["name"] == "[memory]"]
    assert mem == [1990, 2100]  # the level carried in, and the sample inside
    assert doc["distributedInfo"]["rank"] == 3


def test_size_limit_drops_categories_then_fails(tmp_path):
    events = graph_step_events() + [  # 400 cpu_ops of distinct names: they dominate the size
        {"ph": "X", "cat": "cpu_op", "name": f"aten::op_{i * 7919 % 100003}", "pid": 1, "tid": 1,
         "ts": 100 + i, "dur": 1, "args": {"Input Dims": [[i, i + 1]]}} for i in range(400)]
    full = write_events(str(tmp_path / "ops.json"), events)
    assert trim(full, tmp_path / "all.json.gz").returncode == 0
    size_mb = (tmp_path / "all.json.gz").stat().st_size / 1e6
    proc = trim(full, tmp_path / "a.json.gz", "--max-mb", str(size_mb * 0.9))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "dropped categories python_function, cpu_op" in proc.stdout
    proc = trim(full, tmp_path / "b.json.gz", "--max-mb", "0.0001")
    assert proc.returncode == 2 and "still larger" in proc.stderr


def test_missing_step_is_an_error(tmp_path):
    full = write_events(str(tmp_path / "x.json"), [annotation("opsd/prefill", 0, 1)])
    proc = trim(full, tmp_path / "o.json.gz")
    assert proc.returncode != 0 and "no 'opsd/step' range" in proc.stderr

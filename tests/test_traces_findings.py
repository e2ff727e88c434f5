"""The findings block (issue 33, first part): derived from the stage rows' figures, ranked by recoverable time."""

from __future__ import annotations

import json

import pytest

from instrumentation import stages as S
from tests.test_traces_gpu import graph_step_events, report_of
from traces.cli import main
from traces.findings import MAX_FINDINGS, findings, format_findings
from traces.records import GpuFigures, StageRow, Stats
from traces.synth import annotation, write_events

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

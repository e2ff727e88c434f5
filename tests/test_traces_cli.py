"""CLI round trips for every format and flag, and the one-line errors with exit status 2."""

import csv
import io
import json
import subprocess
import sys

import pytest

from instrumentation import stages as S
from traces.cli import main
from traces.synth import annotation, gpu_op, launch, memory, write_events

STEP, PREFILL, DECODE = (S.range_name(s) for s in (S.STEP, S.PREFILL, S.DECODE))


def two_ranks(tmp_path):
    paths = []
    for rank, slow in ((0, 1.0), (1, 2.0)):
        ev = []
        for k in range(2):
            t = 1000.0 * k
            ev += [annotation(STEP, t, 500 * slow), annotation(PREFILL, t + 10, 100 * slow),
                   annotation(DECODE, t + 200, 50), launch(t + 20, 10 * k + 1),
                   gpu_op(t + 30, 40, 10 * k + 1), memory(t + 15, (k + 1) << 20, 4 << 20)]
        paths.append(write_events(str(tmp_path / f"r{rank}.pt.trace.json"), ev, rank=rank))
    return paths


def run_cli(capsys, argv):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_json_schema_round_trip(tmp_path, capsys):
    paths = two_ranks(tmp_path)
    code, out, err = run_cli(capsys, [str(tmp_path), "--format", "json", "--by-rank", "--by-step"])
    assert code == 0 and err == ""
    doc = json.loads(out)
    assert doc["schema_version"] == 4 and sorted(doc["sources"]) == sorted(paths)
    assert doc["ranks"] == [0, 1]
    stage = {s["name"]: s for s in doc["stages"]}
    assert set(stage[STEP]) == {"name", "parent", "count", "cpu_ms", "gpu_ms", "gpu_span_ms", "self_ms",
                                "share", "gpu_share", "launches", "sync_ms", "wait_ms", "bound",
                                "comm_ms", "comm_overlap", "idle_ms", "host_op_ms", "peak_allocated_mib",
                                "peak_reserved_mib", "per_step"}
    assert set(doc["headline"]) == {"stage", "wall_ms", "gpu_busy_pct", "gpu_busy_ms", "idle"}
    assert doc["headline"]["stage"] == STEP and doc["headline"]["wall_ms"] == pytest.approx(2 * 1.5)
    assert set(doc["per_rank"]["1"]) == {"headline", "stages"}
    assert doc["per_rank"]["1"]["headline"]["wall_ms"] == pytest.approx(2.0)
    assert stage[PREFILL]["parent"] == STEP and stage[STEP]["parent"] is None
    assert stage[STEP]["count"] == 4 and stage[PREFILL]["cpu_ms"]["max"] == pytest.approx(0.2)
    assert stage[PREFILL]["gpu_ms"]["total"] == pytest.approx(4 * 0.04)
    assert stage[STEP]["peak_allocated_mib"] == 2 and stage[STEP]["peak_reserved_mib"] == 4
    assert doc["straggler"] == {STEP: 1, PREFILL: 1, DECODE: 0}
    assert set(doc["per_rank"]) == {"0", "1"} and set(doc["per_step"]) == {"0", "1"}


@pytest.mark.parametrize("fmt", ["table", "markdown"])
def test_text_formats(tmp_path, capsys, fmt):
    two_ranks(tmp_path)
    code, out, _ = run_cli(capsys, [str(tmp_path), "--format", fmt, "--by-rank"])
    assert code == 0 and PREFILL in out and "straggler" in out
    if fmt == "markdown":  # the tree: prefill under step; overview + details merged, overview per rank
        assert out.count(f"| &emsp;{PREFILL} |") == 4 and out.count(f"| {STEP} |") == 4


def test_csv_one_row_per_stage_and_rank(tmp_path, capsys):
    two_ranks(tmp_path)
    code, out, _ = run_cli(capsys, [str(tmp_path), "--format", "csv", "--by-rank"])
    rows = list(csv.DictReader(io.StringIO(out)))
    assert code == 0 and len(rows) == 6
    assert {(r["rank"], r["name"]) for r in rows} == {(str(k), n) for k in (0, 1)
                                                      for n in (STEP, PREFILL, DECODE)}
    code, out, _ = run_cli(capsys, [str(tmp_path), "--format", "csv"])
    assert [r["name"] for r in csv.DictReader(io.StringIO(out))] == [STEP, PREFILL, DECODE]


def test_diff_against_saved_report_and_trace(tmp_path, capsys):
    paths = two_ranks(tmp_path)
    _, saved, _ = run_cli(capsys, [paths[0], "--format", "json"])
    (tmp_path / "before.json").write_text(saved)
    for baseline in (str(tmp_path / "before.json"), paths[0]):
        code, out, _ = run_cli(capsys, [paths[1], "--format", "json", "--diff", baseline])
        diff = {d["name"]: d for d in json.loads(out)["diff"]}
        assert code == 0
        assert diff[STEP]["cpu_total_ms"]["relative"] == pytest.approx(1.0)  # 2x slower rank
        assert diff[DECODE]["cpu_total_ms"]["change"] == pytest.approx(0.0)


def test_tensorboard_scalars(tmp_path, capsys):
    two_ranks(tmp_path)
    logdir = tmp_path / "tb"
    code, _, err = run_cli(capsys, [str(tmp_path), "--tensorboard", str(logdir)])
    assert code == 0, err
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    for rank, prefill_ms in ((0, 0.1), (1, 0.2)):  # one run per rank, as the live scalars
        acc = EventAccumulator(str(logdir / f"rank{rank}"))
        acc.Reload()
        scalars = acc.Scalars(f"{PREFILL}/cpu_ms")
        assert [s.step for s in scalars] == [0, 1]
        assert scalars[0].value == pytest.approx(prefill_ms)
        assert {f"{PREFILL}/{k}" for k in ("cpu_ms", "gpu_ms", "self_ms", "peak_allocated_mib")} \
            <= set(acc.Tags()["scalars"])


def test_plot_without_matplotlib_is_a_clear_error_before_any_work(tmp_path, capsys, monkeypatch):
    """Issue 33: matplotlib is a dependency now; without it --plot fails at once, before the report prints."""
    two_ranks(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, out, err = run_cli(capsys, [str(tmp_path), "--plot", str(tmp_path / "p.png")])
    assert code == 2 and "matplotlib" in err and out == ""


@pytest.mark.parametrize("name, problem", [("x.html", "html suffix"), ("x", "no suffix"),
                                           ("missing/x.png", "does not exist")])
def test_an_unwritable_plot_is_refused_before_the_report(tmp_path, capsys, name, problem):
    pytest.importorskip("matplotlib")
    two_ranks(tmp_path)
    code, out, err = run_cli(capsys, [str(tmp_path), "--plot", str(tmp_path / name)])
    assert code == 2 and problem in err
    assert out == ""  # nothing printed: the report was not computed


def test_plot_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    two_ranks(tmp_path)
    for flag in ([], ["--by-step"]):
        png = tmp_path / f"p{len(flag)}.png"
        code, _, err = run_cli(capsys, [str(tmp_path), "--plot", str(png)] + flag)
        assert code == 0, err
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("content,problem", [
    (None, "no such file"), ("", "empty file"), ('{"x": 1}', "no traceEvents"),
    ('{"traceEvents": [{"ph": "X"', "truncated JSON"),
    (json.dumps({"traceEvents": [annotation("foreign", 0, 1)]}), "no user_annotation ranges"),
])
def test_bad_input_one_line_exit_2(tmp_path, content, problem):
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    proc = subprocess.run([sys.executable, "scripts/summarize_trace.py", str(path)],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and problem in lines[0]
    assert "Traceback" not in proc.stderr


def test_multi_rank_set_with_one_bad_file(tmp_path, capsys):
    two_ranks(tmp_path)
    bad = tmp_path / "r2.pt.trace.json.gz"
    bad.write_bytes(b"\x1f\x8b\x08\x00garbage")
    code, out, err = run_cli(capsys, [str(tmp_path), "--format", "json"])
    assert code == 2 and json.loads(out)["ranks"] == [0, 1]
    assert str(bad) in err and len(err.strip().splitlines()) == 1


def test_json_output_is_strict_json_even_with_nan_in_the_trace(tmp_path, capsys):
    ev = [annotation(STEP, 0, 100), launch(10, 1), gpu_op(20, float("nan"), 1)]
    path = write_events(str(tmp_path / "nan.json"), ev)  # json.dumps writes a bare NaN
    code, out, _ = run_cli(capsys, [path, "--format", "json"])

    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    doc = json.loads(out, parse_constant=refuse)
    assert code == 0 and doc["stages"][0]["name"] == STEP


def _runs(tmp_path, steps: dict) -> str:
    """Run directories (with run markers) holding ``steps[name]`` steps each, at identical times."""
    for name, n in steps.items():
        folder = tmp_path / name
        folder.mkdir()
        (folder / ".opsd-run").write_text(json.dumps({"run_id": f"{name}-id"}))
        events = []
        for k in range(n):
            events += [annotation(S.range_name(S.STEP), k * 100, 50), annotation(PREFILL, k * 100 + 1, 10)]
        write_events(str(folder / "rank0.pt.trace.json"), events, rank=0)
    return str(tmp_path)


def test_a_folder_of_runs_is_reported_run_by_run(tmp_path, capsys):
    """Issue 33: two runs under one folder are two reports under their names, steps numbered in each (they were
    merged and renumbered 0-5, and ranges at equal times were even dropped as duplicates across runs)."""
    folder = _runs(tmp_path, {"run-a": 2, "run-b": 3})
    code, out, err = run_cli(capsys, [folder, "--by-step"])
    assert code == 0 and "duplicate" not in err
    a, b = out.index("=== run run-a (id run-a-id) ==="), out.index("=== run run-b (id run-b-id) ===")
    assert a < b
    assert "opsd/step (2 ranges)" in out[a:b] and "opsd/step (3 ranges)" in out[b:]
    assert "\nstep 2\n" not in out[a:b] and "\nstep 2\n" in out[b:]  # steps counted per run
    code, out, _ = run_cli(capsys, [folder, "--format", "json"])
    doc = json.loads(out)
    assert [(r["run"], r["run_id"]) for r in doc["runs"]] == [("run-a", "run-a-id"), ("run-b", "run-b-id")]
    code, out, _ = run_cli(capsys, [folder, "--format", "csv"])
    rows = list(csv.DictReader(io.StringIO(out)))
    assert {r["run"] for r in rows} == {"run-a", "run-b"}
    code, out, _ = run_cli(capsys, [folder, "--format", "markdown"])
    assert "## run run-a (id run-a-id)" in out


def test_one_run_keeps_the_plain_report_and_outputs_of_one_run_only(tmp_path, capsys):
    folder = _runs(tmp_path, {"run-a": 2, "run-b": 1})
    code, out, _ = run_cli(capsys, [str(tmp_path / "run-a")])
    assert code == 0 and "=== run" not in out and "opsd/step (2 ranges)" in out
    code, out, err = run_cli(capsys, [folder, "--tensorboard", str(tmp_path / "tb")])
    assert code == 2 and "2 runs (run-a, run-b)" in err and "--tensorboard takes one run" in err and out == ""


def test_a_baseline_of_several_runs_is_refused_naming_it(tmp_path, capsys):
    folder = _runs(tmp_path, {"run-a": 2, "run-b": 1})
    code, out, _ = run_cli(capsys, [folder, "--format", "json"])
    saved = tmp_path / "runs.json"
    saved.write_text(out)
    code, _, err = run_cli(capsys, [str(tmp_path / "run-a"), "--diff", str(saved)])
    assert code == 2 and "report of 2 runs" in err

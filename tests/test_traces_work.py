"""The report's work columns (traces/work.py): a synthetic trace with a work sidecar, without one, bad lines."""

import json

import pytest

from instrumentation import stages as S
from traces.cli import main
from traces.diff import baseline_problem
from traces.saved import row_from_dict
from traces.synth import annotation, gpu_op, launch, profiler_step, write_events

STEP, BACKWARD, OPTIMIZER = (S.range_name(s) for s in (S.STEP, S.BACKWARD, S.OPTIMIZER_STEP))
#: Per step: backward needs 1 TFLOP at 1 PFLOP/s (1 ms) and 1 GB at 2 TB/s (0.5 ms); the optimizer 4 GB (2 ms).
RATES = {"peak_flops_s": 1e15, "copy_bytes_s": 2e12}
WORK = [{"stage": "backward", "rows": 4, "tokens": 256, "flops": 1e12, "bytes": 1e9},
        {"stage": "optimizer_step", "rows": 0, "tokens": 0, "flops": 0.0, "bytes": 4e9}]


def trace(folder):
    """Steps 1 and 2: backward holds a 2 ms kernel, the optimizer a 3 ms one."""
    events = []
    for k, step in enumerate((1, 2)):
        t, corr = 10_000.0 * k, 10 * k
        events += [profiler_step(step, t, 9000), annotation(STEP, t + 1, 8000), annotation(BACKWARD, t + 10, 2500),
                   launch(t + 20, corr + 1), gpu_op(t + 30, 2000, corr + 1), annotation(OPTIMIZER, t + 3000, 3500),
                   launch(t + 3010, corr + 2), gpu_op(t + 3020, 3000, corr + 2)]
    folder.mkdir(exist_ok=True)
    return write_events(str(folder / "rank0.1.pt.trace.json"), events, rank=0)


def sidecar(folder, lines):
    path = folder / "rank0.work.jsonl"
    path.write_text("".join(x if isinstance(x, str) else json.dumps(x) + "\n" for x in lines))
    return str(path)


def step_lines(steps=(1, 2), rates=RATES):
    return [{"step": s, "rank": 0, **w, **rates} for s in steps for w in WORK]


def summarize(capsys, path, *flags):
    code = main([path, *flags])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_sidecar_gives_roofline_and_x_roofline_per_stage(tmp_path, capsys):
    trace(tmp_path / "run")
    sidecar(tmp_path / "run", step_lines())
    code, out, err = summarize(capsys, str(tmp_path / "run"), "--format", "json")
    assert code == 0 and err == ""
    doc = json.loads(out)
    assert doc["schema_version"] == 4
    rows = {r["name"]: r for r in doc["stages"]}
    assert rows[BACKWARD]["work"] == pytest.approx({"flops": 1e12, "bytes": 1e9, "roofline_ms": 1.0,
                                                    "x_roofline": 2.0, "limit": "compute"})
    assert rows[OPTIMIZER]["work"] == pytest.approx({"flops": 0.0, "bytes": 4e9, "roofline_ms": 2.0,
                                                     "x_roofline": 1.5, "limit": "memory"})
    assert "work" not in rows[STEP]
    code, out, err = summarize(capsys, str(tmp_path / "run"))
    header = next(line for line in out.splitlines() if line.startswith("stage "))
    assert "roofline ms/step" in header and "× roofline" in header and header.rstrip().endswith("limit")
    backward = next(line for line in out.splitlines() if line.strip().startswith(BACKWARD))
    assert backward.split()[-5:] == ["1000.000", "1000.000", "1.000", "2.00", "compute"]


def test_lines_of_steps_outside_the_trace_are_left_out(tmp_path, capsys):
    trace(tmp_path / "run")
    sidecar(tmp_path / "run", step_lines(steps=(1, 2, 3)))  # step 3 is in no trace: ignored
    code, out, _ = summarize(capsys, str(tmp_path / "run"), "--format", "json")
    rows = {r["name"]: r for r in json.loads(out)["stages"]}
    assert code == 0 and rows[BACKWARD]["work"]["x_roofline"] == pytest.approx(2.0)


def test_without_rates_only_the_work_is_shown(tmp_path, capsys):
    trace(tmp_path / "run")
    sidecar(tmp_path / "run", step_lines(rates={"peak_flops_s": None, "copy_bytes_s": None}))
    code, out, _ = summarize(capsys, str(tmp_path / "run"))
    assert code == 0 and "GFLOP/step" in out and "roofline" not in out


def test_a_trace_without_sidecar_gives_the_report_of_before(tmp_path, capsys):
    path = trace(tmp_path / "run")
    code, plain, err = summarize(capsys, path)
    assert code == 0 and err == ""
    assert "roofline" not in plain and "GFLOP" not in plain
    sidecar(tmp_path / "run", step_lines(steps=(7,)))  # a sidecar that matches no step changes nothing
    assert summarize(capsys, path)[1] == plain
    _, out, _ = summarize(capsys, path, "--format", "csv")
    assert "roofline" not in out.splitlines()[0]


def test_bad_sidecar_lines_are_skipped_with_a_warning_naming_the_file(tmp_path, capsys):
    trace(tmp_path / "run")
    good = step_lines()
    bad = ["not json\n", json.dumps({**good[0], "flops": -1.0}) + "\n", '{"step": 1, "rank": 0, "stage": "backward", '
           '"rows": 1, "tokens": 1, "flops": NaN, "bytes": 1}\n', json.dumps({**good[0], "stage": "nope"}) + "\n",
           "[1, 2]\n"]
    path = sidecar(tmp_path / "run", bad + good)
    code, out, err = summarize(capsys, str(tmp_path / "run"), "--format", "json")
    assert code == 0
    assert f"{path}: 5 bad work lines skipped (line 1:" in err
    rows = {r["name"]: r for r in json.loads(out)["stages"]}
    assert rows[BACKWARD]["work"]["x_roofline"] == pytest.approx(2.0)


def test_a_saved_report_with_work_is_a_diff_baseline(tmp_path, capsys):
    trace(tmp_path / "run")
    sidecar(tmp_path / "run", step_lines())
    _, out, _ = summarize(capsys, str(tmp_path / "run"), "--format", "json")
    doc = json.loads(out)
    assert baseline_problem(doc) is None
    row = row_from_dict(next(r for r in doc["stages"] if r["name"] == BACKWARD))
    assert row.work.limit == "compute" and row.work.roofline_ms == pytest.approx(1.0)
    saved = tmp_path / "before.json"
    saved.write_text(out)
    code, out, err = summarize(capsys, str(tmp_path / "run"), "--diff", str(saved))
    assert code == 0 and err == "" and "diff" in out
    with pytest.raises(ValueError, match="work.limit"):
        row_from_dict({**doc["stages"][1], "work": {"flops": 1.0, "bytes": 1.0, "limit": "fast"}})


def test_an_exact_roofline_on_a_line_is_preferred_to_the_max_of_its_totals(tmp_path, capsys):
    """Decode's roofline is a sum over its steps: the line carries it (4 ms here, not max(0.5, 1) ms)."""
    trace(tmp_path / "run")
    lines = [{**x, "roofline_s": 0.004} if x["stage"] == "backward" else x for x in step_lines()]
    sidecar(tmp_path / "run", lines + [json.dumps({**lines[0], "roofline_s": -1.0}) + "\n"])
    code, out, err = summarize(capsys, str(tmp_path / "run"), "--format", "json")
    rows = {r["name"]: r for r in json.loads(out)["stages"]}
    assert code == 0 and "1 bad work line skipped (line 5: roofline_s" in err
    assert rows[BACKWARD]["work"]["roofline_ms"] == pytest.approx(4.0)
    assert rows[BACKWARD]["work"]["x_roofline"] == pytest.approx(0.5)
    assert rows[OPTIMIZER]["work"]["roofline_ms"] == pytest.approx(2.0)  # a line without it: from its totals

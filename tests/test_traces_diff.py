"""--diff: per-call and per-step means with counts, the noise guard, schema-1 baselines, and the diff
in every output format; --plot with --diff."""

import csv
import io
import json

import pytest

from instrumentation import stages as S
from traces.cli import main
from traces.diff import diff_rows, noise_ms, verdict
from traces.rows import StageRow, StepSpread
from traces.synth import annotation, gpu_op, launch, profiler_step, write_events

STEP, PREFILL, DECODE = (S.range_name(s) for s in (S.STEP, S.PREFILL, S.DECODE))


def run(tmp_path, prefill_us: list[float], name: str, decode_calls: int = 2) -> str:
    """A trace of one step per entry of ``prefill_us`` (ProfilerStep#k around step k)."""
    ev, t = [], 0.0
    for k, prefill in enumerate(prefill_us):
        ev += [profiler_step(k, t, 1000), annotation(STEP, t + 1, 900), annotation(PREFILL, t + 10, prefill)]
        ev += [annotation(DECODE, t + 500 + 10 * j, 5) for j in range(decode_calls)]
        t += 1000
    return write_events(str(tmp_path / name), ev, rank=0)


def cli_json(capsys, argv) -> dict:
    assert main(argv + ["--format", "json"]) == 0
    return json.loads(capsys.readouterr().out)


def by_name(diff):
    return {d["name"]: d for d in diff}


def test_per_step_means_make_different_step_counts_comparable(tmp_path, capsys):
    before = run(tmp_path, [100, 110, 90], "before.json")        # 3 steps, prefill 100 +- 10 us
    after = run(tmp_path, [100, 100, 110, 90, 100, 100], "after.json")  # 6 steps, same cost
    d = by_name(cli_json(capsys, [after, "--diff", before])["diff"])[PREFILL]
    assert d["steps"] == {"before": 3, "after": 6} and d["count"] == {"before": 3, "after": 6}
    assert d["cpu_total_ms"]["relative"] == pytest.approx(1.0)   # totals double ...
    assert d["cpu_step_ms"]["before"] == pytest.approx(0.1) and d["cpu_step_ms"]["after"] == pytest.approx(0.1)
    assert d["cpu_step_ms"]["change"] == pytest.approx(0.0)      # ... per step nothing changed
    sd_b, sd_a = (200 / 2) ** 0.5 / 1e3, (200 / 5) ** 0.5 / 1e3  # sample sds (us -> ms): squares sum 200
    assert d["cpu_step_ms"]["noise"] == pytest.approx(noise_ms(sd_b, 3, sd_a, 6))
    assert d["cpu_step_ms"]["significant"] is False and verdict(d) == "within noise"
    assert d["cpu_call_ms"]["before"] == pytest.approx(0.1)


def test_a_real_change_exceeds_the_noise(tmp_path, capsys):
    before = run(tmp_path, [100, 102, 98, 100], "before.json")
    after = run(tmp_path, [150, 152, 148, 150], "after.json", decode_calls=4)
    d = by_name(cli_json(capsys, [after, "--diff", before])["diff"])
    assert d[PREFILL]["cpu_step_ms"]["significant"] is True and verdict(d[PREFILL]) == "cpu slower"
    assert d[PREFILL]["cpu_step_ms"]["relative"] == pytest.approx(0.5)
    assert d[DECODE]["count"] == {"before": 8, "after": 16}        # twice the calls per step ...
    assert d[DECODE]["cpu_call_ms"]["change"] == pytest.approx(0.0)  # ... each as fast


def test_noise_needs_two_steps_on_each_side():
    one = StageRow.from_samples(PREFILL, [1.0], per_step=StepSpread.of([1.0], None))
    two = StageRow.from_samples(PREFILL, [1.0, 3.0], per_step=StepSpread.of([1.0, 3.0], None))
    (d,) = diff_rows([one], [two])
    assert d["cpu_step_ms"]["noise"] is None and d["cpu_step_ms"]["significant"] is None
    assert verdict(d) is None
    assert noise_ms(1.0, 4, 2.0, 4) == pytest.approx(2 * (1 / 4 + 4 / 4) ** 0.5)


def test_schema_1_baseline_is_read(tmp_path, capsys):
    v1 = {"schema_version": 1, "sources": ["x"], "ranks": [0], "warnings": [], "stages": [
        {"name": STEP, "count": 4, "cpu_ms": {"total": 4.0, "mean": 1.0, "p50": 1.0, "p90": 1.0, "max": 1.0},
         "gpu_ms": None, "gpu_span_ms": None, "self_ms": 1.0, "share": 1.0, "peak_allocated_mib": None,
         "peak_reserved_mib": None},
        {"name": PREFILL, "count": 4, "cpu_ms": {"total": 0.4, "mean": 0.1, "p50": 0.1, "p90": 0.1,
                                                 "max": 0.1},
         "gpu_ms": None, "gpu_span_ms": None, "self_ms": 0.4, "share": 0.1, "peak_allocated_mib": None,
         "peak_reserved_mib": None}]}
    baseline = tmp_path / "v1.json"
    baseline.write_text(json.dumps(v1))
    after = run(tmp_path, [200, 200], "after.json")
    d = by_name(cli_json(capsys, [after, "--diff", str(baseline)])["diff"])[PREFILL]
    assert d["steps"]["before"] == 4 and d["cpu_step_ms"]["before"] == pytest.approx(0.1)  # 0.4 ms / 4 steps
    assert d["cpu_step_ms"]["relative"] == pytest.approx(1.0) and d["cpu_step_ms"]["noise"] is None


@pytest.mark.parametrize("fmt", ["table", "markdown", "csv"])
def test_every_format_carries_the_diff(tmp_path, capsys, fmt):
    before = run(tmp_path, [100, 102, 98], "before.json")
    after = run(tmp_path, [150, 152, 148], "after.json")
    assert main([after, "--diff", before, "--format", fmt]) == 0
    out = capsys.readouterr().out
    if fmt == "csv":
        rows = {r["name"]: r for r in csv.DictReader(io.StringIO(out))}
        assert float(rows[PREFILL]["diff_cpu_step_relative"]) == pytest.approx(0.5)
        assert rows[PREFILL]["diff_verdict"] == "cpu slower" and rows[PREFILL]["diff_steps_before"] == "3"
    elif fmt == "markdown":
        line = next(x for x in out.splitlines() if x.startswith(f"| {PREFILL} |") and "slower" in x)
        assert "+50.0%" in line
    else:
        line = next(x for x in out.splitlines() if x.startswith(PREFILL) and "slower" in x)
        assert "+50.0%" in line


def test_csv_keeps_stages_only_in_the_baseline(tmp_path, capsys):
    before = write_events(str(tmp_path / "b.json"), [annotation(STEP, 0, 10), annotation(PREFILL, 1, 2)])
    after = write_events(str(tmp_path / "a.json"), [annotation(STEP, 0, 10)])
    assert main([after, "--diff", before, "--format", "csv"]) == 0
    rows = {r["name"]: r for r in csv.DictReader(io.StringIO(capsys.readouterr().out))}
    assert rows[PREFILL]["count"] == "" and rows[PREFILL]["diff_count_before"] == "1"


def test_plot_with_diff_draws_both(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    before = run(tmp_path, [100, 102, 98], "before.json")
    after = run(tmp_path, [150, 152, 148], "after.json")
    png = tmp_path / "d.png"
    assert main([after, "--diff", before, "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_diff_is_ready_for_a_pr(tmp_path, capsys):
    """Issue 33: the headline first (with the noise's n and a verdict), then a compact table of at most 100
    columns (stage | before | after | Δ ms | Δ % | ± noise | verdict) even with a long stage name; --diff-wide
    prints every figure."""
    before = run(tmp_path, [100, 102, 98], "before.json")
    after = run(tmp_path, [150, 152, 148], "after.json")
    assert main([after, "--diff", before]) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith("diff: step (CPU ms/step): ") and "(n = 3 + 3 steps)" in first
    assert first.endswith(": within noise")  # the step's time is the same on both sides here
    table = out[out.index("\ndiff (per-step CPU ms"):].splitlines()[2:]
    assert table[0].split() == ["stage", "before", "after", "Δ", "ms", "Δ", "%", "±", "noise", "verdict"]
    prefill = next(line for line in table if line.startswith(PREFILL))
    assert prefill.split()[1:] == ["0.100", "0.150", "+0.050", "+50.0%", "0.003", "cpu", "slower"]
    assert "n = 3 + 3 steps" in out and max(len(line) for line in table) <= 100
    assert main([after, "--diff", before, "--diff-wide"]) == 0
    wide = capsys.readouterr().out
    assert "cpu/step b" in wide and "cpu/call a" in wide


def test_a_compact_diff_shortens_long_names_to_fit():
    from traces.diff import COMPACT_WIDTH, format_diff
    long = "opsd/" + "a_very_long_user_stage_name_" * 3
    rows = diff_rows([StageRow.from_samples(long, [1.0, 2.0])], [StageRow.from_samples(long, [3.0, 4.0])])
    text = format_diff(rows)
    assert max(len(line) for line in text.splitlines()) <= COMPACT_WIDTH and "…" in text
    assert format_diff(rows, "markdown").count(long) == 1  # Markdown keeps the whole name


def call_trace(tmp_path, name: str, kernels: list[tuple[str, float]]) -> str:
    """A traced rollout call (no ``opsd/step`` range): one decode range whose launches ran ``kernels`` (name, us)."""
    ev, t = [annotation(S.range_name(S.ROLLOUT), 0, 5000), annotation(DECODE, 10, 4000)], 20.0
    for corr, (kernel, us) in enumerate(kernels, start=1):
        ev += [launch(t, corr), gpu_op(t + 5, us, corr, name=kernel)]
        t += us + 10
    return write_events(str(tmp_path / name), ev, rank=0)


def test_a_diff_of_calls_without_steps_compares_totals(tmp_path, capsys):
    before = call_trace(tmp_path, "before.json", [("gemm", 300.0), ("attention", 400.0)])
    after = call_trace(tmp_path, "after.json", [("gemm", 200.0), ("attention", 440.0)])
    doc = cli_json(capsys, [after, "--diff", before])
    d = by_name(doc["diff"])[DECODE]
    assert d["gpu_step_ms"] is None and d["gpu_total_ms"]["change"] == pytest.approx(-0.06)
    assert main([after, "--diff", before]) == 0
    text = capsys.readouterr().out
    assert "GPU ms over each side's traces: no opsd/step ranges" in text
    line = next(row for row in text.splitlines() if row.startswith(DECODE) and "-0.060" in row)
    assert "0.700" in line and "0.640" in line and "-8.6%" in line  # before, after, Δ ms and Δ %: not dashes


def test_kernels_with_a_diff_name_what_changed(tmp_path, capsys):
    before = call_trace(tmp_path, "before.json", [("gemm_a", 300.0), ("attention", 400.0), ("norm", 5.0)])
    after = call_trace(tmp_path, "after.json", [("gemm_b", 200.0), ("reduce", 30.0), ("attention", 440.0),
                                                ("norm", 5.0)])
    doc = cli_json(capsys, [after, "--diff", before, "--kernels", "3"])
    changes = by_name(doc["diff"])[DECODE]["kernels"]
    assert [k["kernel"] for k in changes] == ["gemm_a", "gemm_b", "attention"]  # largest |Δ| first, 3 of 5 names
    gone, new, slower = changes
    assert gone["calls_after"] == 0 and gone["change_ms"] == pytest.approx(-0.3) and gone["relative"] == -1.0
    assert new["calls_before"] == 0 and new["before_ms"] == 0.0 and new["relative"] is None
    assert slower["change_ms"] == pytest.approx(0.04) and slower["relative"] == pytest.approx(0.1)
    assert main([after, "--diff", before, "--kernels", "3"]) == 0
    text = capsys.readouterr().out
    table = text[text.index("kernels that changed most per stage"):]
    assert "attention" in table and "+0.040" in table and "+10.0%" in table and "norm" not in table


def test_kernels_against_a_saved_report_warn_that_it_keeps_no_kernel_lists(tmp_path, capsys):
    before = call_trace(tmp_path, "before.json", [("gemm", 300.0)])
    after = call_trace(tmp_path, "after.json", [("gemm", 200.0)])
    saved = tmp_path / "before-report.json"
    assert main([before, "--format", "json", "--kernels", "2"]) == 0
    saved.write_text(capsys.readouterr().out)
    assert main([after, "--diff", str(saved), "--kernels", "2"]) == 0
    captured = capsys.readouterr()
    assert "keeps no kernel lists" in captured.err and "kernels that changed most" not in captured.out


def test_stages_whose_kernels_ran_alike_list_no_kernel_changes(tmp_path, capsys):
    before = call_trace(tmp_path, "before.json", [("gemm", 300.0), ("norm", 5.0)])
    after = call_trace(tmp_path, "after.json", [("gemm", 300.0), ("norm", 5.0004)])  # 0.4 ns: below MIN_CHANGE_MS
    doc = cli_json(capsys, [after, "--diff", before, "--kernels", "3"])
    assert all("kernels" not in d for d in doc["diff"])
    assert main([after, "--diff", before, "--kernels", "3"]) == 0
    assert "kernels that changed most" not in capsys.readouterr().out

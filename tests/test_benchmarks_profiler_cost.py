"""benchmarks.profiler_cost on the CPU stand-in workload: it runs, writes its result file, and its
statistics are right (the GPU figures come from the lead's H200 runs)."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks import profiler_cost, profiler_host
from benchmarks.harness import results

ROOT = Path(__file__).resolve().parent.parent


def bench_module():
    return profiler_cost


@pytest.mark.parametrize("df,expected", [(5, 2.0150), (10, 1.8125), (49, 1.6766), (119, 1.6578)])
def test_t_quantile(df, expected):  # one-sided 95% quantiles of Student's t (tables)
    assert bench_module().t_quantile_95(df) == pytest.approx(expected, rel=5e-4)


def test_paired_cost_and_ratio():
    b = bench_module()
    off = [100.0, 102.0, 98.0, 100.0]
    on = [101.0, 103.0, 99.0, 101.0]  # exactly 1 ms more in every pair: no spread
    cost = b.paired_cost(on, off)
    assert cost["relative"] == pytest.approx(0.01) and cost["ucb95_t"] == pytest.approx(0.01)
    ratio = b.ratio_of_medians([2.0, 2.0, 2.0], [1.0, 1.0, 1.0])
    assert (ratio["ratio"], ratio["low"], ratio["high"]) == (2.0, 2.0, 2.0)
    rng = np.random.default_rng(1)
    noisy = b.paired_cost(list(100 + rng.normal(0, 1, 60)), list(100 + rng.normal(0, 1, 60)))
    assert noisy["ucb95_t"] > noisy["relative"]


def run(*args, tmp_path, workload="synthetic", job=()):
    out = tmp_path / "out.json"
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.profiler_cost", *args, "--workload", workload,
                           "--output-dir", str(tmp_path / "traces"), "--json-out", str(out), *job],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = results.read(str(out))
    assert doc.schema == 1 and doc.meta["command"][:4] == ["python", "-m", "benchmarks.profiler_cost", args[0]]
    return proc.stdout, doc.rows[0]


def test_light_measure_runs(tmp_path):
    stdout, result = run("light", "--pairs", "3", "--warmup", "1", tmp_path=tmp_path)
    assert result["pairs"] == 3 and result["order"] == ["on", "off", "off", "on", "on", "off"]
    assert "95% upper bound" in stdout and (Path(result["scalars_dir"]).exists())


def test_light_measure_runs_the_main_jobs_step(tmp_path):
    """The OPSD workload builds the main job's step and inputs (the embedded tiny models on the CPU): it broke
    silently once when the job's prompt helpers moved."""
    _, result = run("light", "--pairs", "2", "--warmup", "1", "--fixed-work", tmp_path=tmp_path, workload="opsd",
                    job=("--", "--batch-size", "1", "--samples-per-prompt", "2", "--max-new-tokens", "4",
                         "--prompt-len", "8"))
    assert result["pairs"] == 2 and result["workload"] == "opsd"


def test_host_measure_times_every_entry_point_in_both_arms(tmp_path):
    """The host measure on the main job's step: every entry point has a time in both arms; in ``reread`` the
    work records read the models again (time inside them), and the wrappers are gone afterwards."""
    _, result = run("host", "--steps", "4", "--warmup", "1", "--fixed-work", "--gc-freeze", tmp_path=tmp_path,
                    workload="opsd",
                    job=("--", "--batch-size", "1", "--samples-per-prompt", "2", "--max-new-tokens", "4",
                         "--prompt-len", "8"))
    assert result["gc_freeze"] is True
    labels = {label for label, _, _ in profiler_host.HOST_ENTRY_POINTS} | {"step (wall)"}
    for arm in profiler_host.HOST_ARMS:
        medians = result["median_ms"][arm]
        assert set(medians) == labels and len(result["ms"][arm]["step (wall)"]) == 2
        assert medians["work record: training"] > 0 and medians["stage() enter + exit"] > 0
        assert 0 < profiler_host.on_path_ms(medians) < medians["step (wall)"]


def test_entry_timer_counts_the_outermost_call_and_restores(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(profiler_host.time, "perf_counter", lambda: clock[0])

    class Owner:
        def f(self, n):  # each body takes one second of the fake clock
            clock[0] += 1.0
            return self.f(n - 1) + 1 if n else 0

    obj = Owner()
    timer = profiler_host.EntryTimer()
    timer.wrap(Owner, "f", "f")
    assert obj.f(3) == 3
    assert timer.totals == {"f": 4000.0}  # four bodies once, not 4 + 3 + 2 + 1 seconds
    timer.restore()
    assert Owner.__dict__["f"].__qualname__.endswith("Owner.f")
    timer.wrap(obj, "f", "bound")  # an object's method: shadowed, then removed
    assert "f" in vars(obj) and obj.f(1) == 1 and timer.totals["bound"] == 2000.0
    timer.restore()
    assert "f" not in vars(obj)


def test_linger_measure_runs(tmp_path):
    stdout, result = run("linger", "--steps", "9", "--window", "3-4", tmp_path=tmp_path)
    assert result["window"] == [3, 4] and len(result["step_ms"]) == 13 and len(result["traces"]) == 2
    assert [c["label"] for c in result["graph_checks"]] == ["after window 3-4", "after window 9-10"]
    assert "after / before" in stdout


def test_before_drift_flags_a_workload_still_warming_up():
    b = bench_module()
    assert b.before_drift([100.0, 100.0, 100.0, 100.0]) == 0.0
    assert b.before_drift([440.0, 430.0, 450.0, 560.0, 590.0, 620.0]) == pytest.approx(590.0 / 440.0 - 1)
    assert b.before_drift([1.0, 2.0, 3.0]) is None  # too few steps to split
    rising = {"window": [5, 6], "second_window": [9, 10], "median_before_ms": 1.0, "median_recorded_ms": 1.0,
              "median_after_ms": 1.0, "recorded_over_before": 1.0, "export_ms": 0.0, "graph_checks": [],
              "after_over_before": {"ratio": 1.0, "low": 1.0, "high": 1.0}, "workload": "synthetic",
              "device": "cpu", "torch": "x", "cuda": None, "teardown_cupti": False}
    import contextlib
    import io
    for drift, warned in ((0.25, True), (0.01, False), (None, False)):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            b.print_linger({**rising, "before_drift": drift})
        assert ("WARNING: the steps before the window drifted" in out.getvalue()) is warned


@pytest.mark.parametrize("argv, message", [
    (["host", "--steps", "1"], "argument --steps: must be an int >= 2; got '1'"),  # one arm would have no step
    (["light", "--pairs", "1"], "argument --pairs: must be an int >= 2; got '1'"),  # no spread from one pair
    (["light", "--warmup", "-1"], "argument --warmup: must be an int >= 0; got '-1'"),
    (["light", "--pairs", "x"], "argument --pairs: must be an int >= 2; got 'x'"),
    (["linger", "--steps", "10", "--window", "3-2"], "--window='3-2' is not valid"),
    (["linger", "--steps", "6", "--window", "3-4"], "--window 3-4 must start at step >= 3 and end at least 4 steps"),
])
def test_bad_counts_and_windows_are_refused_naming_the_flag(capsys, argv, message):
    """They raised tracebacks (KeyError, TypeError, ValueError) after building the workload."""
    with pytest.raises(SystemExit) as info:
        profiler_cost.parse_args(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["stage", "--calls", "0"], "argument --calls: must be an int >= 1; got '0'"),  # divided by it
    (["stage", "--repeats", "0"], "argument --repeats: must be an int >= 1; got '0'"),
    (["rollout", "--batch-size", "0"], "argument --batch-size: must be an int >= 1; got '0'"),
])
def test_the_overhead_benchmark_refuses_counts_below_one(capsys, argv, message):
    from benchmarks import overhead

    with pytest.raises(SystemExit) as info:
        overhead.main(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err

"""opsd-summarize on bad input (issue 34): implausible times, ranges outside every step, overlapping steps, bad
rank metadata, bad --diff baselines, empty path flags, very long names; and an MFU above 100%."""

import copy
import json
import warnings

import pytest

from instrumentation import mfu as mfu_module
from instrumentation.mfu import mfu
from traces.cli import main


def _ev(name, ts, dur, pid=1):
    return {"ph": "X", "cat": "user_annotation", "name": name, "pid": pid, "tid": 1, "ts": ts, "dur": dur,
            "args": {}}


def _doc(pid=1, rank=0, world_size=1):
    events = []
    for s in range(3):
        t0 = 1000 + s * 100000
        events += [_ev("opsd/step", t0, 90000, pid), _ev("opsd/rollout", t0 + 10, 40000, pid),
                   _ev("opsd/backward", t0 + 60300, 20000, pid)]
    return {"schemaVersion": 1, "distributedInfo": {"rank": rank, "world_size": world_size}, "traceEvents": events}


def _write(tmp_path, doc, name="t.json"):
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return str(path)


def _json(tmp_path, doc, capsys, *flags):
    rc = main([_write(tmp_path, doc), "--format", "json", *flags])
    captured = capsys.readouterr()
    return rc, json.loads(captured.out), captured.err


def _stage(report, name):
    return next(s for s in report["stages"] if s["name"] == name)


@pytest.mark.parametrize("field,value", [("dur", 1e300), ("dur", 10 ** 30), ("ts", 1e300), ("dur", 2e12)])
def test_implausible_time_is_skipped_with_a_warning(tmp_path, capsys, field, value):
    doc = _doc()
    doc["traceEvents"][1][field] = value  # the first opsd/rollout
    rc, report, err = _json(tmp_path, doc, capsys)
    assert rc == 0
    assert f"implausible {field}" in err and "'opsd/rollout'" in err
    assert [s["name"] for s in report["stages"]][0] == "opsd/step"  # not moved above the step
    rollout = _stage(report, "opsd/rollout")
    assert rollout["count"] == 2 and rollout["cpu_ms"]["max"] == pytest.approx(40.0)
    assert "nested" not in err


def test_range_outside_every_step_is_warned(tmp_path, capsys):
    doc = _doc()
    doc["traceEvents"][1]["ts"] = 500000  # after the last step
    rc, report, err = _json(tmp_path, doc, capsys)
    assert rc == 0
    line = next(x for x in err.splitlines() if "outside every 'opsd/step'" in x)
    assert "1 'opsd/rollout'" in line and "rank 0" in line
    rollout = _stage(report, "opsd/rollout")
    assert rollout["count"] == 3 and rollout["per_step"]["n"] == 3


def test_overlapping_steps_are_warned(tmp_path, capsys):
    doc = _doc()
    doc["traceEvents"][3]["ts"] = 51000  # step 1 starts inside step 0
    rc, _, err = _json(tmp_path, doc, capsys)
    assert rc == 0 and "1 'opsd/step' range overlaps the previous one" in err


def test_good_trace_has_no_step_warning(tmp_path, capsys):
    rc, report, err = _json(tmp_path, _doc(), capsys)
    assert rc == 0 and err == "" and report["warnings"] == []


def test_two_processes_of_one_rank_are_warned(tmp_path, capsys):
    doc = _doc()
    doc["traceEvents"] += _doc(pid=2)["traceEvents"]
    rc, _, err = _json(tmp_path, doc, capsys)
    assert rc == 0 and "'opsd/step' ranges of 2 processes (pids 1, 2)" in err


@pytest.mark.parametrize("info,expected", [
    ({"rank": 5, "world_size": 2}, "distributedInfo.rank 5 is not below distributedInfo.world_size 2"),
    ({"rank": "zero", "world_size": 1}, "distributedInfo.rank 'zero' is not an integer >= 0"),
    ({"rank": True, "world_size": 2}, "distributedInfo.rank True is not an integer >= 0"),
    ({"rank": 0, "world_size": -1}, "distributedInfo.world_size -1 is not an integer >= 1"),
    ("x", "distributedInfo is not an object"),
])
def test_bad_distributed_info_is_warned(tmp_path, capsys, info, expected):
    doc = _doc()
    doc["distributedInfo"] = info
    rc, report, err = _json(tmp_path, doc, capsys)
    assert rc == 0 and expected in err
    assert len([x for x in err.splitlines() if "distributedInfo" in x]) >= 1


def test_long_name_is_cut_in_the_table_only(tmp_path, capsys):
    doc = _doc()
    long = "opsd/" + "x" * 100000
    doc["traceEvents"][1]["name"] = long
    path = _write(tmp_path, doc)
    assert main([path]) == 0
    table = capsys.readouterr().out
    assert max(len(x) for x in table.splitlines()) < 400 and "…" in table
    assert main([path, "--format", "csv"]) == 0
    assert long in capsys.readouterr().out
    assert main([path, "--format", "json"]) == 0
    assert long in capsys.readouterr().out


@pytest.mark.parametrize("stage,field", [(5, "stages[0] must be an object"), ({"count": 1}, "stages[0].name")])
def test_baseline_stage_not_an_object_names_the_field(tmp_path, capsys, stage, field):
    rc, report, _ = _json(tmp_path, _doc(), capsys)
    base = copy.deepcopy(report)
    base["stages"][0] = stage
    base_path = _write(tmp_path, base, "base.json")
    assert main([_write(tmp_path, _doc()), "--diff", base_path]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0] and base_path in err[0] and "AttributeError" not in err[0]


@pytest.mark.parametrize("flag", ["--plot", "--tensorboard", "--diff"])
def test_empty_path_flag_is_refused(tmp_path, capsys, flag):
    assert main([_write(tmp_path, _doc()), flag, ""]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and f"{flag}: empty path" in captured.err


@pytest.mark.parametrize("below", ["", "sub"])
def test_tensorboard_file_is_refused_up_front(tmp_path, capsys, below):
    trace = _write(tmp_path, _doc())
    target = f"{trace}/{below}" if below else trace
    assert main([trace, "--tensorboard", target]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # before the report
    assert captured.err.count("\n") == 1 and "--tensorboard" in captured.err and "not a directory" in captured.err


def test_mfu_above_one_warns_once_and_absurd_values_are_not_reported(monkeypatch):
    monkeypatch.setattr(mfu_module, "_warned_above_one", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert mfu(1e15, 1.0, 1e-288) is None  # 1e303: not a figure to print
        assert mfu(2e15, 1.0, 1e15) == pytest.approx(2.0)  # shown, and not warned twice
    assert len(caught) == 1
    text = str(caught[0].message)
    assert "\n" not in text and "too low" in text and "OPSD_PEAK_TFLOPS" in text and len(text) < 200
    assert mfu(5e14, 1.0, 1e15) == pytest.approx(0.5)
    assert mfu(1.0, 1.0, float("nan")) is None

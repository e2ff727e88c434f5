"""scripts/trim_trace.py on bad input: one ``error:`` line naming the path or flag, exit 2, no file left behind."""

import gzip
import json

import pytest

from scripts.trim_trace import main


def _events():
    out = []
    for s in range(3):
        t0 = 1000 + s * 100000
        out += [{"ph": "X", "cat": "user_annotation", "name": "opsd/step", "pid": 1, "tid": 1, "ts": t0, "dur": 90000},
                {"ph": "X", "cat": "user_annotation", "name": "opsd/rollout", "pid": 1, "tid": 1, "ts": t0 + 10,
                 "dur": 40000},
                {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": t0 + 20, "dur": 100,
                 "args": {"x": "y" * 200}}]
    return out


@pytest.fixture
def good(tmp_path):
    path = tmp_path / "good.json"
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": _events()}))
    return path


def _one_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert "Traceback" not in err[0]
    return err[0]


def test_output_is_a_directory(good, tmp_path, capsys):
    assert main([str(good), str(tmp_path)]) == 2
    line = _one_error(capsys)
    assert str(tmp_path) in line and "directory" in line


@pytest.mark.parametrize("case", ["out_dir", "out_parent_missing", "src_missing", "src_empty", "src_truncated",
                                  "src_truncated_gz"])
def test_path_mistakes_are_one_line(case, good, tmp_path, capsys):
    src, out = good, tmp_path / "out.json.gz"
    if case == "out_dir":
        out = tmp_path
    elif case == "out_parent_missing":
        out = tmp_path / "nope" / "out.json.gz"
    elif case == "src_missing":
        src = tmp_path / "missing.json"
    elif case == "src_empty":
        src = tmp_path / "empty.json"
        src.write_bytes(b"")
    elif case == "src_truncated":
        src = tmp_path / "trunc.json"
        src.write_bytes(good.read_bytes()[:-50])
    else:
        src = tmp_path / "trunc.json.gz"
        raw = gzip.compress(good.read_bytes())
        src.write_bytes(raw[:len(raw) // 2])
    assert main([str(src), str(out)]) == 2
    line = _one_error(capsys)
    named = out if case.startswith("out") else src
    assert str(named) in line
    assert not (tmp_path / "out.json.gz").exists()


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "abc"])
def test_max_mb_must_be_finite_and_positive(value, good, tmp_path, capsys):
    out = tmp_path / "out.json.gz"
    with pytest.raises(SystemExit) as exc:
        main([str(good), str(out), "--max-mb", value])
    assert exc.value.code == 2
    assert "--max-mb must be a finite number > 0" in capsys.readouterr().err
    assert not out.exists()


def test_too_large_output_is_not_left_on_disk(good, tmp_path, capsys):
    out = tmp_path / "out.json.gz"
    assert main([str(good), str(out), "--max-mb", "1e-9"]) == 2
    line = _one_error(capsys)
    assert str(out) in line and "not written" in line and "--max-mb" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.json"]


def test_too_large_output_keeps_an_existing_file(good, tmp_path, capsys):
    out = tmp_path / "out.json.gz"
    out.write_bytes(b"previous")
    assert main([str(good), str(out), "--max-mb", "1e-9"]) == 2
    assert out.read_bytes() == b"previous"


def test_missing_step_names_the_flag(good, tmp_path, capsys):
    out = tmp_path / "out.json.gz"
    assert main([str(good), str(out), "--step", "9"]) == 2
    line = _one_error(capsys)
    assert "--step" in line and str(good) in line and not out.exists()
    assert main([str(good), str(out), "--stage", "x/none"]) == 2
    assert "--stage" in _one_error(capsys)


def test_good_trim_writes_the_step(good, tmp_path, capsys):
    out = tmp_path / "out.json.gz"
    assert main([str(good), str(out)]) == 0
    doc = json.loads(gzip.decompress(out.read_bytes()))
    assert {e["ts"] for e in doc["traceEvents"] if e["name"] == "opsd/step"} == {201000}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.json", "out.json.gz"]

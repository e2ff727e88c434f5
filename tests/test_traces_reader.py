"""The streaming Chrome-trace reader against an independent json.load extraction, and its errors."""

import gzip
import json

import pytest

import traces.chrome as chrome
import traces.textfile as textfile
from traces.bad import BAD
from traces.events import GPU, LAUNCH, MEMORY, OP, RANGE, SYNC, TraceError
from traces.synth import SynthConfig, annotation, gpu_op, launch, memory, sync, write_events, \
    write_synthetic_trace


def reference_tuples(doc: dict) -> list[tuple]:
    """The kept events of a whole-loaded document, extracted without traces.chrome."""
    out = []
    for e in doc["traceEvents"]:
        cat, args = e.get("cat"), e.get("args") or {}
        if cat == "user_annotation":
            out.append((RANGE, e["name"], e["pid"], e["tid"], e["ts"], e["dur"]))
        elif cat == "cpu_op":
            out.append((OP, e["name"], e["pid"], e["tid"], e["ts"], e["dur"]))
        elif cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            out.append((GPU, args["correlation"], e["ts"], e["dur"], args["device"], e["name"],
                        args.get("stream", -1)))
        elif cat in ("cuda_runtime", "cuda_driver") and e["name"].endswith("Synchronize"):
            out.append((SYNC, e["pid"], e["tid"], e["ts"], e["dur"]))
        elif cat in ("cuda_runtime", "cuda_driver"):
            out.append((LAUNCH, e["pid"], e["tid"], e["ts"], args["correlation"]))
        elif e.get("name") == "[memory]":
            out.append((MEMORY, e["pid"], e["ts"], args["Device Type"], args["Device Id"],
                        args["Total Allocated"], args["Total Reserved"]))
    return out


def read(path):
    return [t for t in chrome.read_chrome_trace(path) if t[0] in (RANGE, GPU, LAUNCH, MEMORY, SYNC, OP)]


@pytest.mark.parametrize("chunk_chars", [1 << 23, 997])
@pytest.mark.parametrize("compress", [False, True])
def test_synthetic_trace_matches_json_load(tmp_path, monkeypatch, chunk_chars, compress):
    monkeypatch.setattr(textfile, "CHUNK_CHARS", chunk_chars)
    path = str(tmp_path / ("s.json.gz" if compress else "s.json"))
    write_synthetic_trace(path, SynthConfig(target_bytes=150_000, num_decode_steps=2,
                                            ops_per_stage=4, rank=1, world_size=2), compress=compress)
    with (gzip.open if compress else open)(path, "rt") as f:
        expected = reference_tuples(json.load(f))
    assert len(expected) > 200
    assert read(path) == expected
    assert ("rank" in [t[1] for t in chrome.read_chrome_trace(path) if t[0] == 5])


EVENTS = [annotation("opsd/step", 0, 100), annotation("opsd/a}, {b", 5, 10),
          annotation('quote " and \\ and {', 20, 5), launch(30, 7, driver=True), gpu_op(40, 5, 7),
          memory(50, 1024, 2048), {"ph": "X", "cat": "cpu_op", "name": "x}, {y", "pid": 1,
                                   "tid": 1, "ts": 1, "dur": 1, "args": {"l": [{"a": 1}, {"b": 2}]}},
          launch(60, 8), gpu_op(70, 1, 8, cat="gpu_memset"), sync(80, 30),
          gpu_op(85, 2, 9, name='void k<\\"a\\">(int)', stream=13), launch(75, 9)]


@pytest.mark.parametrize("indent", [None, 2])
@pytest.mark.parametrize("chunk_chars", [1 << 23, 7, 64])
def test_odd_layouts_braces_in_strings_and_chunking(tmp_path, monkeypatch, indent, chunk_chars):
    monkeypatch.setattr(textfile, "CHUNK_CHARS", chunk_chars)
    path = write_events(str(tmp_path / "o.json"), EVENTS, rank=4, indent=indent)
    assert read(path) == reference_tuples({"traceEvents": EVENTS})
    assert (5, "rank", 4) in list(chrome.read_chrome_trace(path))


def test_array_format_and_metadata_after_events(tmp_path):
    p = tmp_path / "a.json"
    p.write_text(json.dumps(EVENTS))
    assert read(str(p)) == reference_tuples({"traceEvents": EVENTS})
    p2 = tmp_path / "b.json"
    p2.write_text(json.dumps({"traceEvents": EVENTS, "distributedInfo": {"rank": 6}}))
    assert (5, "rank", 6) in list(chrome.read_chrome_trace(str(p2)))


def test_malformed_kept_event_is_counted_not_fatal(tmp_path):
    bad = {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 1, "dur": 1,
           "args": {}}  # no correlation
    path = write_events(str(tmp_path / "m.json"), [annotation("opsd/step", 0, 1), bad])
    tuples = list(chrome.read_chrome_trace(path))
    assert (BAD, "no 'correlation' field", "'k' at ts 1.0") in tuples and tuples[0][0] == RANGE


def _truncated_gz(tmp_path):
    data = gzip.compress(json.dumps({"traceEvents": EVENTS * 50}).encode())
    p = tmp_path / "t.json.gz"
    p.write_bytes(data[: len(data) // 2])
    return str(p)


def _text(name, text):
    def make(d):
        (d / name).write_text(text)
        return str(d / name)
    return make


@pytest.mark.parametrize("make,match", [
    (lambda d: str(d / "missing.json"), "no such file"),
    (lambda d: str(d), "is a directory"),
    (_text("e.json", ""), "empty file"),
    (_text("w.json", "  \n "), "empty file"),
    (_text("n.json", '{"a": [1, 2]}'), "no traceEvents"),
    (_text("x.json", "hello"), "not JSON"),
    (_text("u.json", '{"traceEvents": [{"ph": "X"}, {"ph"'), "truncated JSON"),
    (_text("v.json", '{"traceEvents": [{"ph": "X"}, '), "truncated JSON"),
    (_truncated_gz, "truncated or corrupt gzip"),
])
def test_errors_name_file_and_problem(tmp_path, make, match):
    path = make(tmp_path)
    with pytest.raises(TraceError, match=match) as info:
        list(chrome.read_chrome_trace(path))
    assert str(info.value).startswith(path)

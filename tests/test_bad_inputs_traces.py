"""Bad inputs and faults of the summarizer (``opsd-summarize``), one row each, with the exact outcome.

Every row puts one bad thing next to a good trace of rank 0 (``GOOD``), runs the CLI in-process with
``--format json`` and asserts: the exit status (2 when an input was bad, 0 otherwise), the stderr
lines (each expected pattern matches exactly one line, and there are no other lines: ONE warning
line per file), the ranks reported (the good ones always are), that stdout is strict JSON (no NaN /
Infinity) and, where the bad thing is an extra ``opsd/prefill`` range, that the prefill total is
the good ranges' only (bad values never reach a total).
"""

import builtins
import gzip
import json
import os
import re
import signal
import sqlite3

import pytest

from instrumentation import stages as S
from traces import load as load_module
from traces import report as report_module
from traces.cli import main
from traces.synth import annotation, gpu_op, launch, memory, write_events

STEP, PREFILL = S.range_name(S.STEP), S.range_name(S.PREFILL)
GOOD = [annotation(STEP, 0, 100), annotation(PREFILL, 10, 20), launch(12, 1), gpu_op(15, 5, 1)]
PREFILL_MS = 0.02  # one good prefill range per rank
DEEP = 100_000

#: A kernel in Kineto's exact layout (read by the reader's fast path, without JSON decoding).
KINETO_KERNEL = """{{
    "ph": "X", "cat": "kernel", "name": "k_{corr}", "pid": 0, "tid": 7,
    "ts": {ts}, "dur": {dur},
    "args": {{
      "queued": 0, "device": 0, "context": 1, "stream": 7, "correlation": {corr}
    }}
  }}"""

#: An allocator sample in Kineto's exact layout (the fast path).
KINETO_MEMORY = """{{
    "ph": "i", "cat": "cpu_instant_event", "s": "t", "name": "[memory]", "pid": 1, "tid": 1,
    "ts": {ts},
    "args": {{
      "Total Reserved": {reserved}, "Total Allocated": {allocated}, "Bytes": 0, "Device Id": 0, "Device Type": 1
    }}
  }}"""


def _strict(text):
    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def _trace(tmp_path, name="rank1.pt.trace.json", extra=(), rank=1, text_events=()):
    """A rank's good events plus ``extra`` events (dicts), and raw event texts appended as is."""
    path = str(tmp_path / name)
    write_events(path, GOOD + list(extra), rank=rank)
    if text_events:
        with open(path) as f:
            doc = f.read()
        head, tail = doc.rsplit("]", 1)
        with open(path, "w") as f:
            f.write(head + "".join(", " + t for t in text_events) + "]" + tail)
    return path


def _deep_args(name=PREFILL, ts=40.0):
    return ('{"ph": "X", "cat": "user_annotation", "name": "%s", "pid": 1, "tid": 1, "ts": %s, "dur": 5, '
            '"args": %s1%s}' % (name, ts, '{"a": ' * DEEP, "}" * DEEP))


def _with(key, value, base=None):
    ev = dict(base or annotation(PREFILL, 40, 7))
    if value is _DROP:
        ev.pop(key)
    else:
        ev[key] = value
    return ev


_DROP = object()


def _nsys(tmp_path, name, nvtx_rows, kernel_rows=()):
    """A minimal ``nsys export --type sqlite`` file (rank from its name)."""
    path = str(tmp_path / name)
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE NVTX_EVENTS (start INTEGER, end INTEGER, text TEXT, globalTid INTEGER, "
                 "eventType INTEGER)")
    conn.executemany("INSERT INTO NVTX_EVENTS VALUES (?, ?, ?, ?, 59)", nvtx_rows)
    conn.execute("CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER, end INTEGER, globalPid INTEGER, "
                 "correlationId INTEGER, shortName TEXT)")
    conn.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?, ?, ?, ?, ?)", kernel_rows)
    conn.commit()
    conn.close()
    return path


GTID = (1 << 24) | 1
NVTX_GOOD = [(0, 100_000, STEP, GTID), (10_000, 30_000, PREFILL, GTID)]


def _unreadable(path, monkeypatch):
    """Make ``path`` unreadable: permissions, and (as root, which ignores them) the calls that read it."""
    os.chmod(path, 0)
    if os.geteuid() != 0:
        return
    denied = os.path.realpath(path)

    def check(p):
        if isinstance(p, (str, os.PathLike)) and os.path.realpath(p) == denied:
            raise PermissionError(13, "Permission denied", os.fspath(p))

    real_scandir, real_open = os.scandir, builtins.open
    monkeypatch.setattr(os, "scandir", lambda p=".": check(p) or real_scandir(p))
    monkeypatch.setattr(builtins, "open", lambda p, *a, **k: check(p) or real_open(p, *a, **k))


def _crash_on(path, monkeypatch, where):
    """Make the reader (``"read"``) or the report (``"report"``) raise on ``path`` only."""
    if where == "read":
        real = load_module.collect

        def collect(p, events):
            if p == path:
                raise RuntimeError("injected reader bug")
            return real(p, events)

        monkeypatch.setattr(load_module, "collect", collect)
    else:
        real = report_module.file_instances

        def instances(data, *args, **kwargs):
            if data.path == path:
                raise ZeroDivisionError("injected report bug")
            return real(data, *args, **kwargs)

        monkeypatch.setattr(report_module, "file_instances", instances)
    return path


def _one(t, extra=(), text_events=()):
    """Row inputs: the good file and a rank-1 file with extra (bad) events; messages name the latter."""
    bad = _trace(t, extra=extra, text_events=text_events)
    return [str(t / "rank0.pt.trace.json"), bad], [bad]


def _file(t, name, content: bytes):
    path = t / name
    path.write_bytes(content)
    return [str(t / "rank0.pt.trace.json"), str(path)], [str(path)]


def _truncated_gzip(t, m):
    data = gzip.compress(json.dumps({"traceEvents": GOOD}).encode())
    return _file(t, "rank1.pt.trace.json.gz", data[:len(data) // 2])


def _crash(t, m, where):
    path = _crash_on(_trace(t), m, where)
    return [str(t / "rank0.pt.trace.json"), path], [path]


def _only_bad(t, m):
    path = str(t / "rank5.pt.trace.json")
    write_events(path, [_with("pid", [1], annotation(STEP, 0, 100)), _with("dur", -1, annotation(PREFILL, 1, 2))])
    return [path], [path]


def _diff(t, m, baseline):
    return [str(t / "rank0.pt.trace.json"), "--diff", baseline], [baseline]


def _saved_report_with_nan(t, m):
    doc = {"schema_version": 2, "stages": [{"name": PREFILL, "count": 1, "cpu_ms": {"total": float("nan")}}]}
    (t / "report.json").write_text(json.dumps(doc))
    return _diff(t, m, str(t / "report.json"))


SAVED_ROW = {"name": PREFILL, "count": 1, "cpu_ms": {"total": 0.02, "mean": 0.02, "p50": 0.02, "p90": 0.02,
                                                     "max": 0.02}}


def _saved_report(t, m, doc):
    (t / "report.json").write_text(json.dumps(doc))
    return _diff(t, m, str(t / "report.json"))


def _saved_report_text(t, m, total: str):
    """A saved report whose prefill row's CPU total is the JSON text ``total``."""
    row = json.dumps(SAVED_ROW).replace('"total": 0.02', '"total": ' + total)
    (t / "report.json").write_text('{"schema_version": 3, "stages": [%s]}' % row)
    return _diff(t, m, str(t / "report.json"))


def _run_dir(t):
    d = t / "dir"
    d.mkdir()
    os.replace(t / "rank0.pt.trace.json", d / "rank0.pt.trace.json")
    return d


def _special_file(t, m, kind):
    d = _run_dir(t)
    if kind == "fifo":
        os.mkfifo(d / "rank1.pt.trace.json")
    else:
        os.symlink("/dev/zero", d / "rank1.pt.trace.json")  # read, it would never end
    return [str(d)], [str(d / "rank1.pt.trace.json")]


def _fifo_argument(t, m, alone=False):
    os.mkfifo(t / "fifo.pt.trace.json")
    good = [] if alone else [str(t / "rank0.pt.trace.json")]
    return good + [str(t / "fifo.pt.trace.json")], [str(t / "fifo.pt.trace.json")]


def _unreadable_below(t, m, what):
    d = _run_dir(t)
    sub = d / "sub"
    sub.mkdir()
    _trace(d, "rank1.pt.trace.json")
    _trace(sub, "rank2.pt.trace.json", rank=2)
    target = str(sub if what == "directory" else sub / "rank2.pt.trace.json")
    _unreadable(target, m)
    return [str(d)], [target]


def _partials_in_run_dir(t, m):
    d = _run_dir(t)
    _trace(d, "rank1.pt.trace.json")
    (d / "rank2.1.partial").mkdir()  # what a killed export leaves (instrumentation.export)
    (d / "rank2.1.partial" / "trace.json").write_text('{"traceEvents": [')
    (d / "rank3.pt.trace.json.gz.partial").write_bytes(b"\x1f\x8b half")
    return [str(d)], [str(d), str(d / "rank2.1.partial"), str(d / "rank3.pt.trace.json.gz.partial")]


# name -> (build(tmp_path, monkeypatch) -> (argv, paths the messages name), exit status,
#          stderr patterns ({0}, {1} ... = those paths), ranks reported (None: no report), prefill total ms)
CASES = {
    # -- bad events: skipped, counted, named in ONE warning line per file; every file still reported
    "pid is a list": (lambda t, m: _one(t, [_with("pid", [1])]), 0,
                      [r"warning: {0}: skipped 1 bad event: 1 with pid not an integer \(first: 'opsd/prefill' "
                       r"at ts 40\.0\)"], [0, 1], 2 * PREFILL_MS),
    "tid is an object": (lambda t, m: _one(t, [_with("tid", {"a": 1})]), 0,
                         [r"warning: {0}: skipped 1 bad event: 1 with tid not an integer"], [0, 1], 2 * PREFILL_MS),
    "100k-deep event inside the array": (
        lambda t, m: _one(t, text_events=[_deep_args(), json.dumps(annotation("opsd/decode", 60, 1))]), 0,
        [r"warning: {0}: skipped 1 bad event: 1 with nesting too deep to decode \(first: 'opsd/prefill' "
         r"at ts 40\.0\)"], [0, 1], 2 * PREFILL_MS),
    "100k-deep event closing the array": (lambda t, m: _one(t, text_events=[_deep_args()]), 0,
                                          [r"warning: {0}: skipped 1 bad event: 1 with nesting too deep"],
                                          [0, 1], 2 * PREFILL_MS),
    "dur -50": (lambda t, m: _one(t, [_with("dur", -50)]), 0,
                [r"warning: {0}: skipped 1 bad event: 1 with negative dur \(first: 'opsd/prefill'"], [0, 1],
                2 * PREFILL_MS),
    "dur NaN": (lambda t, m: _one(t, [_with("dur", float("nan"))]), 0,
                [r"warning: {0}: skipped 1 bad event: 1 with non-finite dur"], [0, 1], 2 * PREFILL_MS),
    "dur Infinity": (lambda t, m: _one(t, [_with("dur", float("inf"))]), 0,
                     [r"warning: {0}: skipped 1 bad event: 1 with non-finite dur"], [0, 1], 2 * PREFILL_MS),
    "ts -Infinity": (lambda t, m: _one(t, [_with("ts", float("-inf"))]), 0,
                     [r"warning: {0}: skipped 1 bad event: 1 with non-finite ts"], [0, 1], 2 * PREFILL_MS),
    "ts + dur past the largest float": (lambda t, m: _one(t, [_with("dur", 1.7e308, _with("ts", 1.7e308))]), 0,
                                        [r"warning: {0}: skipped 1 bad event: 1 with end beyond the largest float"],
                                        [0, 1], 2 * PREFILL_MS),
    "kernel dur NaN": (lambda t, m: _one(t, [launch(50, 9), gpu_op(52, float("nan"), 9)]), 0,
                       [r"warning: {0}: skipped 1 bad event: 1 with non-finite dur \(first: 'k' at ts 52\.0\)"],
                       [0, 1], 2 * PREFILL_MS),
    "kernel dur -5 in Kineto's layout": (lambda t, m: _one(t, text_events=[KINETO_KERNEL.format(ts=52, dur=-5, corr=9)]),
                                         0, [r"warning: {0}: skipped 1 bad event: 1 with negative dur \(first: 'k_9'"],
                                         [0, 1], 2 * PREFILL_MS),
    "correlation beyond int64": (lambda t, m: _one(t, text_events=[KINETO_KERNEL.format(ts=52, dur=5, corr=10**20)]),
                                 0, [r"warning: {0}: skipped 1 bad event: 1 with fields of the wrong type "
                                     r"\(OverflowError\)"], [0, 1], 2 * PREFILL_MS),
    "kernel args is a list": (lambda t, m: _one(t, [_with("args", [1], gpu_op(52, 5, 9))]), 0,
                              [r"warning: {0}: skipped 1 bad event: 1 with args not an object"], [0, 1], 2 * PREFILL_MS),
    "name is a number": (lambda t, m: _one(t, [_with("name", 7)]), 0,
                         [r"warning: {0}: skipped 1 bad event: 1 with name not a string"], [0, 1], 2 * PREFILL_MS),
    "no dur": (lambda t, m: _one(t, [_with("dur", _DROP)]), 0,
               [r"warning: {0}: skipped 1 bad event: 1 with no 'dur' field"], [0, 1], 2 * PREFILL_MS),
    "six bad events, four reasons: one line": (
        lambda t, m: _one(t, [_with("pid", [1]), _with("pid", "x"), _with("dur", -1), _with("dur", -2),
                              _with("ts", float("nan")), _with("name", None)]), 0,
        [r"warning: {0}: skipped 6 bad events: 2 with negative dur \(first: 'opsd/prefill' at ts 40\.0\), "
         r"2 with pid not an integer \(.*\), 1 with name not a string \(.*\), 1 with non-finite ts \(.*\)"],
        [0, 1], 2 * PREFILL_MS),
    "nsys: text in NVTX start": (
        lambda t, m: _nsys_row(t, NVTX_GOOD + [("soon", 40_000, PREFILL, GTID)]), 0,
        [r"warning: {0}: skipped 1 bad event: 1 with start not a number \(first: 'opsd/prefill'\)"],
        [0, 1], 2 * PREFILL_MS),
    "nsys: text in kernel end": (lambda t, m: _nsys_row(t, NVTX_GOOD, [(12_000, "late", 1, 5, "k")]), 0,
                                 [r"warning: {0}: skipped 1 bad event: 1 with end not a number"], [0, 1], 2 * PREFILL_MS),
    "nsys: text in globalTid": (lambda t, m: _nsys_row(t, NVTX_GOOD + [(40_000, 45_000, PREFILL, "t1")]), 0,
                                [r"warning: {0}: skipped 1 bad event: 1 with globalTid not an integer"], [0, 1],
                                2 * PREFILL_MS),
    "non-object elements in traceEvents": (
        lambda t, m: _one(t, text_events=["1", "null", '"x"', "[2, {}]"]), 0,
        [r"warning: {0}: skipped 4 bad events: 4 with element not an object \(first: 1\)"], [0, 1], 2 * PREFILL_MS),
    "negative allocator sample": (lambda t, m: _one(t, [memory(41, -5 << 30)]), 0,
                                  [r"warning: {0}: skipped 1 bad event: 1 with negative Total Allocated \(first: "
                                   r"'\[memory\]' at ts 41\.0\)"], [0, 1], 2 * PREFILL_MS),
    "negative reserved bytes in Kineto's layout": (
        lambda t, m: _one(t, text_events=[KINETO_MEMORY.format(ts=41, reserved=-1, allocated=1 << 20)]), 0,
        [r"warning: {0}: skipped 1 bad event: 1 with negative Total Reserved"], [0, 1], 2 * PREFILL_MS),
    # -- the same range twice: counted once, one warning line per file naming the stage and the rank
    "the same opsd/step twice in one file": (
        lambda t, m: _one(t, [annotation(STEP, 0, 100)]), 0,
        [r"warning: {0}: rank 1: 1 'opsd/step' range repeated exactly; counted once"], [0, 1], 2 * PREFILL_MS),
    "opsd/step nested in itself": (
        lambda t, m: _one(t, [annotation(STEP, 1, 98)]), 0,
        [r"warning: {0}: rank 1: 1 'opsd/step' range nested in another 'opsd/step'; counted once \(the outer "
         r"range\): wrap a stage once \(docs/profiling\.md\)"], [0, 1], 2 * PREFILL_MS),
    # -- bad files: named (exit 2); the other inputs still reported
    "not JSON": (lambda t, m: _file(t, "rank1.pt.trace.json", b"garbage"), 2,
                 [r"error: {0}: not JSON \(expected an object with traceEvents\)"], [0], PREFILL_MS),
    "truncated gzip": (_truncated_gzip, 2, [r"error: {0}: truncated or corrupt gzip .*"], [0], PREFILL_MS),
    "reader fails on one file": (lambda t, m: _crash(t, m, "read"), 2,
                                 [r"error: {0}: cannot be read \(RuntimeError: injected reader bug\)"], [0], PREFILL_MS),
    "report fails on one file": (lambda t, m: _crash(t, m, "report"), 2,
                                 [r"error: {0}: cannot be summarised \(ZeroDivisionError: injected report bug\)"],
                                 [0], PREFILL_MS),
    "a file of bad events only": (_only_bad, 2,
                                  [r"warning: {0}: skipped 2 bad events: .*",
                                   r"error: {0}: no user_annotation ranges matching prefix 'opsd/'"], None, None),
    # -- --diff: the message names the actual bad input, the report of the good one is printed
    "--diff baseline with a list pid": (lambda t, m: _diff(t, m, _trace(t, "base.pt.trace.json", [_with("pid", [1])])),
                                        0, [r"warning: {0}: skipped 1 bad event: 1 with pid not an integer .*"], [0],
                                        PREFILL_MS),
    "--diff baseline not JSON": (lambda t, m: _diff(t, m, _file(t, "base.json", b"garbage")[1][0]), 2,
                                 [r"error: {0}: not JSON \(expected an object with traceEvents\) \(--diff baseline\)"],
                                 [0], PREFILL_MS),
    "--diff saved report with NaN": (_saved_report_with_nan, 2,
                                     [r"error: {0}: --diff baseline is not a valid report \(ValueError: "
                                      r"non-standard JSON constant NaN\)"], [0], PREFILL_MS),
    "--diff saved report of an unknown schema version": (
        lambda t, m: _saved_report(t, m, {"schema_version": 99, "stages": [SAVED_ROW]}), 2,
        [r"error: {0}: --diff baseline has schema_version 99; this opsd-summarize reads 1, 2, 3"], [0], PREFILL_MS),
    "--diff saved report, schema_version a string": (
        lambda t, m: _saved_report(t, m, {"schema_version": "3", "stages": [SAVED_ROW]}), 2,
        [r"error: {0}: --diff baseline has schema_version '3'; this opsd-summarize reads 1, 2, 3"], [0], PREFILL_MS),
    "--diff saved report without stages": (
        lambda t, m: _saved_report(t, m, {"schema_version": 3, "stages": []}), 2,
        [r"error: {0}: --diff baseline holds no stages \(an empty 'stages' list\)"], [0], PREFILL_MS),
    "--diff saved report, stages not a list": (
        lambda t, m: _saved_report(t, m, {"schema_version": 3, "stages": {"a": 1}}), 2,
        [r"error: {0}: --diff baseline holds no stages \('stages' is not a list\)"], [0], PREFILL_MS),
    **{f"--diff saved report, cpu total {text}": (
        lambda t, m, text=text: _saved_report_text(t, m, text), 2,
        [r"error: {0}: --diff baseline is not a valid report \(ValueError: stage entry 'opsd/prefill' is not a "
         r"report row \(cpu_ms\.total: " + re.escape(shown) + r" is not a finite number >= 0\)\)"], [0], PREFILL_MS)
       for text, shown in (('"abc"', "'abc'"), ("1e400", "inf"), ("-5", "-5"), ("[1]", "[1]"), ("true", "True"))},
    # -- skipped without being opened; reported when unreadable
    "FIFO named like a trace": (lambda t, m: _special_file(t, m, "fifo"), 0,
                                [r"warning: {0}: not a regular file \(a FIFO\); skipped without opening it"], [0],
                                PREFILL_MS),
    "/dev/zero named like a trace": (lambda t, m: _special_file(t, m, "device"), 0,
                                     [r"warning: {0}: not a regular file \(a character device\); skipped without "
                                      r"opening it"], [0], PREFILL_MS),
    "FIFO named on the command line": (_fifo_argument, 0, [r"warning: {0}: not a regular file \(a FIFO\); .*"], [0],
                                       PREFILL_MS),
    "only a FIFO": (lambda t, m: _fifo_argument(t, m, alone=True), 2,
                    [r"warning: {0}: not a regular file \(a FIFO\); .*",
                     r"error: {0}: no trace to report \(every input was skipped\)"], None, None),
    "unreadable subdirectory": (lambda t, m: _unreadable_below(t, m, "directory"), 2,
                                [r"error: {0}: cannot read directory \(Permission denied\); the traces below it are "
                                 r"not in the report"], [0, 1], 2 * PREFILL_MS),
    "unreadable file": (lambda t, m: _unreadable_below(t, m, "file"), 2,
                        [r"error: {0}: cannot open \(Permission denied\)"], [0, 1], 2 * PREFILL_MS),
    "*.partial export left in a run directory": (
        _partials_in_run_dir, 0, [r"warning: {0}: skipped 2 incomplete export\(s\) \(\*\.partial: still being written, "
                                  r"or left by a killed run\): {1}, {2}"], [0, 1], 2 * PREFILL_MS),
    "*.partial named on the command line": (
        lambda t, m: _file(t, "rank1.pt.trace.json.gz.partial", b"\x1f\x8b half"), 0,
        [r"warning: {0}: an incomplete export \(\*\.partial\); skipped"], [0], PREFILL_MS),
}


def _nsys_row(t, nvtx_rows, kernel_rows=()):
    path = _nsys(t, "rank1.sqlite", nvtx_rows, kernel_rows)
    return [str(t / "rank0.pt.trace.json"), path], [path]


class Blocked(BaseException):
    """Raised by the alarm of :func:`no_hang` (not an ``OSError``: nothing on the way may swallow it)."""


@pytest.fixture
def no_hang():
    """Fail (instead of hanging) when a row blocks, e.g. on opening a FIFO."""
    def expire(signum, frame):
        raise Blocked("the summarizer blocked for 30 s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(30)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input(name, tmp_path, monkeypatch, capsys, no_hang):
    build, code, patterns, ranks, prefill_ms = CASES[name]
    write_events(str(tmp_path / "rank0.pt.trace.json"), GOOD, rank=0)
    argv, named = build(tmp_path, monkeypatch)
    assert main(argv + ["--format", "json"]) == code
    out, err = capsys.readouterr()
    lines = err.splitlines()
    for pattern in patterns:
        regex = re.compile(pattern.format(*(re.escape(p) for p in named)))
        assert len([line for line in lines if regex.match(line)]) == 1, (regex.pattern, lines)
    assert len(lines) == len(patterns), lines
    if ranks is None:
        assert out == ""
        return
    doc = _strict(out)  # strict JSON: no NaN / Infinity
    assert doc["ranks"] == ranks
    prefill = {s["name"]: s for s in doc["stages"]}[PREFILL]
    assert prefill["cpu_ms"]["total"] == pytest.approx(prefill_ms)


def test_the_bad_file_does_not_hide_the_good_ones_in_any_format(tmp_path, capsys):
    write_events(str(tmp_path / "rank0.pt.trace.json"), GOOD, rank=0)
    bad = _trace(tmp_path, extra=[_with("pid", [1]), _with("dur", float("nan"))])
    (tmp_path / "rank2.pt.trace.json").write_text("{")
    for fmt in ("table", "markdown", "csv"):
        assert main([str(tmp_path), "--format", fmt, "--by-rank", "--by-step"]) == 2
        out, err = capsys.readouterr()
        assert PREFILL in out and "nan" not in out.lower()
        assert [line.split(": ")[0] for line in err.splitlines()] == ["warning", "error"]
        assert bad in err.splitlines()[0] and "rank2.pt.trace.json" in err.splitlines()[1]


def test_traceback_switch_is_checked(tmp_path, capsys, monkeypatch):
    write_events(str(tmp_path / "rank0.pt.trace.json"), GOOD, rank=0)
    monkeypatch.setenv("OPSD_TRACEBACK", "maybe")
    assert main([str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip() == ("error: OPSD_TRACEBACK='maybe' is not valid; accepted: one of 1, true, "
                                         "yes, on, 0, false, no, off")


def _steps(nested: bool, duplicate: bool = False):
    """Three 100 us steps of a 49 us rollout, each step wrapped once more in opsd/step when ``nested``
    (docs/profiling.md's loop around ``OPSDStep.step``), or written twice when ``duplicate``."""
    events = []
    for k in range(3):
        t0 = 200.0 * k
        events += [annotation(STEP, t0, 100), annotation(S.range_name(S.ROLLOUT), t0 + 10, 49)]
        if nested:
            events.append(annotation(STEP, t0 + 1, 98))
        if duplicate:
            events.append(annotation(STEP, t0, 100))
    return events


@pytest.mark.parametrize("kind", ["nested", "duplicate"])
def test_a_step_counted_twice_does_not_halve_the_shares(kind, tmp_path, capsys):
    path = str(tmp_path / "rank3.pt.trace.json")
    write_events(path, _steps(kind == "nested", kind == "duplicate"), rank=3)
    assert main([path, "--format", "json"]) == 0
    out, err = capsys.readouterr()
    doc = _strict(out)
    rows = {s["name"]: s for s in doc["stages"]}
    assert rows[STEP]["count"] == 3
    assert rows[STEP]["cpu_ms"]["total"] == pytest.approx(0.3)
    assert rows[S.range_name(S.ROLLOUT)]["share"] == pytest.approx(0.49)
    assert doc["headline"]["wall_ms"] == pytest.approx(rows[STEP]["cpu_ms"]["total"])
    what = "nested in another 'opsd/step'" if kind == "nested" else "repeated exactly"
    assert err.splitlines() == [f"warning: {path}: rank 3: 3 'opsd/step' ranges {what}; counted once"
                                + (" (the outer range): wrap a stage once (docs/profiling.md)" if kind == "nested" else "")]


def test_consecutive_ranges_of_a_stage_are_not_nested(tmp_path, capsys):
    decode = S.range_name(S.DECODE)
    path = str(tmp_path / "rank0.pt.trace.json")
    write_events(path, [annotation(STEP, 0, 100)] + [annotation(decode, 10 + 5 * k, 5) for k in range(4)]
                 + [annotation(decode, 30, 0)], rank=0)
    assert main([path, "--format", "json"]) == 0
    out, err = capsys.readouterr()
    assert {s["name"]: s["count"] for s in _strict(out)["stages"]}[decode] == 5 and err == ""


def test_non_objects_first_in_the_array_keep_the_good_events(tmp_path, capsys):
    path = tmp_path / "rank0.pt.trace.json"
    good = json.dumps({"traceEvents": GOOD})
    path.write_text(good.replace('{"traceEvents": [', '{"traceEvents": [7, "x", true, '))
    assert main([str(path), "--format", "json"]) == 0
    out, err = capsys.readouterr()
    assert {s["name"] for s in _strict(out)["stages"]} == {STEP, PREFILL}
    assert err.splitlines() == [f"warning: {path}: skipped 3 bad events: 3 with element not an object (first: 7)"]


def test_negative_allocator_samples_never_give_a_negative_peak(tmp_path, capsys):
    path = str(tmp_path / "rank0.pt.trace.json")
    write_events(path, GOOD + [memory(5, 1 << 20), memory(12, -5 << 30), memory(14, 2 << 20, -1)], rank=0)
    assert main([path, "--format", "json"]) == 0
    out, err = capsys.readouterr()
    prefill = {s["name"]: s for s in _strict(out)["stages"]}[PREFILL]
    assert prefill["peak_allocated_mib"] == pytest.approx(1.0)
    assert "skipped 2 bad events: 1 with negative Total Allocated" in err


@pytest.mark.parametrize("where", ["before", "after"])
def test_whitespace_around_a_trace_is_streamed_not_held(where, tmp_path, capsys, monkeypatch):
    """A gzip of 64 MiB of whitespace before (or after) a good trace: read in chunks, never held whole."""
    import tracemalloc

    from traces import textfile

    monkeypatch.setattr(textfile, "CHUNK_CHARS", 1 << 20)
    path = tmp_path / "rank0.pt.trace.json.gz"
    with gzip.open(path, "wb", compresslevel=1) as f:
        if where == "after":
            f.write(json.dumps({"traceEvents": GOOD}).encode())
        for _ in range(64):
            f.write(b" " * (1 << 20))
        if where == "before":
            f.write(json.dumps({"traceEvents": GOOD}).encode())
    tracemalloc.start()
    try:
        assert main([str(path), "--format", "json"]) == 0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert {s["name"] for s in _strict(capsys.readouterr().out)["stages"]} == {STEP, PREFILL}
    assert peak < 16 << 20, peak  # 64 MiB of text held whole before


NAMES = {  # raw name in the trace -> how the report writes it
    "lone surrogate": ("opsd/\ud800x", "opsd/\\ud800x"),
    "newline faking a row": ("opsd/x\n| fake | row |", "opsd/x\\n| fake | row |"),
    "terminal escape": ("opsd/\u001b[31mred", "opsd/\\x1b[31mred"),
}


class _Stdout:
    """A strict UTF-8 stdout, as a terminal or a pipe has (capsys accepts anything)."""

    def __init__(self):
        import io

        self.raw = io.BytesIO()
        self.stream = io.TextIOWrapper(self.raw, encoding="utf-8", errors="strict", newline="\n")

    def text(self):
        self.stream.flush()
        return self.raw.getvalue().decode("utf-8")


@pytest.mark.parametrize("fmt", ["table", "markdown", "csv", "json"])
@pytest.mark.parametrize("case", list(NAMES))
def test_names_are_printable_in_every_format(case, fmt, tmp_path, monkeypatch, capsys):
    raw, shown = NAMES[case]
    kernel = dict(gpu_op(33, 1, 1), name=raw.replace("opsd/", "kernel "))
    path = str(tmp_path / "rank0.pt.trace.json")
    write_events(path, GOOD + [annotation(raw, 30, 4), kernel], rank=0)  # valid JSON: json escapes them
    stdout = _Stdout()
    monkeypatch.setattr("sys.stdout", stdout.stream)
    assert main([path, "--format", fmt, "--kernels", "3"]) == 0
    out = stdout.text()
    err = capsys.readouterr().err  # CSV has no kernel lists: said once
    assert err == ("" if fmt != "csv" else "warning: --kernels 3: the CSV output has no kernel lists (use --format "
                                           "table, markdown or json): ignored\n")
    if fmt == "json":
        doc = _strict(out)
        assert shown in {s["name"] for s in doc["stages"]}
        assert {k["name"] for s in doc["stages"] for k in s["kernels"] or ()} >= {shown.replace("opsd/", "kernel ")}
        return
    assert shown.split("|")[0] in out  # Markdown escapes the '|' of a cell
    assert fmt == "csv" or shown.split("|")[0].replace("opsd/", "kernel ") in out
    assert not re.search(r"[\x00-\x09\x0b-\x1f\x7f]", out)
    assert not any(line.startswith(("| fake", "row", " row")) for line in out.splitlines())


def test_run_names_and_paths_are_printable(tmp_path, monkeypatch, capsys):
    """Run directories (and marker ids) named with a newline or an escape sequence: one heading line each,
    one stderr line per warning."""
    for k, (name, run_id) in enumerate([("r\n=== run fake ===", "id\x1b[2J"), ("r2", "ok")]):
        folder = tmp_path / name
        folder.mkdir()
        (folder / ".opsd-run").write_text(json.dumps({"run_id": run_id}))
        write_events(str(folder / "rank0.pt.trace.json"), GOOD + ([_with("pid", [1])] if k == 0 else []), rank=0)
    stdout = _Stdout()
    monkeypatch.setattr("sys.stdout", stdout.stream)
    assert main([str(tmp_path), "--format", "table"]) == 0
    out, err = stdout.text(), capsys.readouterr().err
    headings = [line for line in out.splitlines() if line.startswith("===")]
    assert headings == ["=== run r\\n=== run fake === (id id\\x1b[2J) ===", "=== run r2 (id ok) ==="]
    assert len(err.splitlines()) == 1 and "r\\n=== run fake ===" in err and "\x1b" not in out + err
    assert main([str(tmp_path), "--format", "csv"]) == 0
    assert "r\\n=== run fake ===" in stdout.text() and "\x1b" not in stdout.text()


def test_a_non_utf8_stdout_gets_escapes_not_an_error(tmp_path, monkeypatch, capsys):
    import io

    path = str(tmp_path / "rank0.pt.trace.json")
    write_events(path, GOOD + [annotation("opsd/café", 30, 4)], rank=0)
    raw = io.BytesIO()
    stream = io.TextIOWrapper(raw, encoding="ascii", errors="strict")
    monkeypatch.setattr("sys.stdout", stream)
    assert main([path, "--format", "table"]) == 0
    stream.flush()
    assert "opsd/caf\\xe9" in raw.getvalue().decode("ascii") and capsys.readouterr().err == ""


def test_names_of_a_saved_baseline_are_printable(tmp_path, monkeypatch, capsys):
    path = str(tmp_path / "rank0.pt.trace.json")
    write_events(path, GOOD, rank=0)
    (tmp_path / "report.json").write_text(json.dumps({"schema_version": 3, "stages": [
        dict(SAVED_ROW, name="opsd/\ud800\n| x |", parent="opsd/\x1b[2J")]}))
    stdout = _Stdout()
    monkeypatch.setattr("sys.stdout", stdout.stream)
    assert main([path, "--diff", str(tmp_path / "report.json"), "--format", "table"]) == 0
    out = stdout.text()
    assert "opsd/\\ud800\\n| x |" in out and not re.search(r"[\x00-\x09\x0b-\x1f]", out)
    assert capsys.readouterr().err == ""

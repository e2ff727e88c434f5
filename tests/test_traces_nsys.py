"""Nsight Systems SQLite input: databases built here with the documented export schema (a subset).

Tables and columns follow the "SQLite Export Schema Reference" of Nsight Systems: ``StringIds``,
``NVTX_EVENTS`` (eventType 59 push/pop, 60 start/end, 34 mark, 75 domain create), the CUPTI
runtime / driver API tables and the kernel / memcpy / memset tables; times in ns; serialized
``globalTid`` = ``pid << 24 | tid`` (plus high bits), ``globalPid`` = ``pid << 24``.
"""

import json
import os
import sqlite3

import pytest

from instrumentation import stages as S
from traces import cli
from traces.chrome import read_chrome_trace
from traces.events import RANGE
from traces.load import load, read_trace
from traces.nsys import pid_of, read_nsys_sqlite, tid_of
from traces.report import build_report
from traces.synth import annotation, gpu_op, launch, write_events

MS = 1_000_000  # ns
HIGH = 1 << 56  # the high bits real exports carry in serialized ids
MAIN, AUTOGRAD = 1, 2
PID, OTHER_PID = 100, 200

SCHEMA = """
CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE NVTX_EVENTS (start INT NOT NULL, end INT, eventType INT NOT NULL, rangeId INT,
    category INT, color INT, text TEXT, globalTid INT, endGlobalTid INT,
    textId INT REFERENCES StringIds(id), domainId INT, uint64Value INT, int64Value INT,
    doubleValue REAL, uint32Value INT, int32Value INT, floatValue REAL, jsonTextId INT, jsonText TEXT);
CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INT NOT NULL, end INT NOT NULL, eventClass INT NOT NULL,
    globalTid INT, correlationId INT, nameId INT NOT NULL, returnValue INT NOT NULL, callchainId INT);
CREATE TABLE CUPTI_ACTIVITY_KIND_DRIVER (start INT NOT NULL, end INT NOT NULL, eventClass INT NOT NULL,
    globalTid INT, correlationId INT, nameId INT NOT NULL, returnValue INT NOT NULL, callchainId INT);
CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INT NOT NULL, end INT NOT NULL, deviceId INT NOT NULL,
    contextId INT NOT NULL, streamId INT NOT NULL, correlationId INT, globalPid INT,
    demangledName INT NOT NULL, shortName INT NOT NULL);
CREATE TABLE CUPTI_ACTIVITY_KIND_MEMCPY (start INT NOT NULL, end INT NOT NULL, deviceId INT NOT NULL,
    contextId INT NOT NULL, streamId INT NOT NULL, correlationId INT, globalPid INT, bytes INT NOT NULL,
    copyKind INT NOT NULL);
CREATE TABLE CUPTI_ACTIVITY_KIND_MEMSET (start INT NOT NULL, end INT NOT NULL, deviceId INT NOT NULL,
    contextId INT NOT NULL, streamId INT NOT NULL, correlationId INT, globalPid INT, value INT NOT NULL,
    bytes INT NOT NULL);
"""


RUNTIME, DRIVER = "CUPTI_ACTIVITY_KIND_RUNTIME", "CUPTI_ACTIVITY_KIND_DRIVER"
KERNEL, MEMCPY, MEMSET = "CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_MEMCPY", "CUPTI_ACTIVITY_KIND_MEMSET"
#: The NOT NULL columns of each GPU table besides the common ones (filled with 0).
GPU_EXTRA_COLUMNS = {KERNEL: "demangledName, shortName", MEMCPY: "bytes, copyKind", MEMSET: "value, bytes"}


def gtid(pid, tid):
    return HIGH | (pid << 24) | tid


def gpid(pid):
    return HIGH | (pid << 24)


class Db:
    """Writes rows of the documented schema; registered strings go through ``StringIds``."""

    def __init__(self, path, schema=SCHEMA):
        self.path = str(path)
        self.conn = sqlite3.connect(self.path)
        self.conn.executescript(schema)
        self.strings = {}

    def sid(self, text):
        if text not in self.strings:
            self.strings[text] = len(self.strings) + 1
            self.conn.execute("INSERT INTO StringIds VALUES (?, ?)", (self.strings[text], text))
        return self.strings[text]

    def nvtx(self, event_type, start, end, name, pid=PID, tid=MAIN, domain=0, registered=True):
        text, text_id = (None, self.sid(name)) if registered else (name, None)
        self.conn.execute("INSERT INTO NVTX_EVENTS (start, end, eventType, text, globalTid, textId, domainId) "
                          "VALUES (?, ?, ?, ?, ?, ?, ?)", (start, end, event_type, text, gtid(pid, tid),
                                                           text_id, domain))

    def domain(self, domain_id, name, pid=PID):
        self.nvtx(75, 0, None, name, pid=pid, domain=domain_id, registered=False)

    def push(self, name, start_ms, end_ms, **kw):
        self.nvtx(59, int(start_ms * MS), None if end_ms is None else int(end_ms * MS), name, **kw)

    def api(self, table, at_ms, corr, pid=PID, tid=MAIN):
        self.conn.execute(f"INSERT INTO {table} VALUES (?, ?, 0, ?, ?, 1, 0, NULL)",
                          (int(at_ms * MS), int(at_ms * MS) + 2000, gtid(pid, tid), corr))

    def gpu(self, table, start_ms, end_ms, corr, pid=PID, device=0):
        extra = GPU_EXTRA_COLUMNS[table]
        self.conn.execute(f"INSERT INTO {table} (start, end, deviceId, contextId, streamId, correlationId, "
                          f"globalPid, {extra}) VALUES (?, ?, ?, 1, 7, ?, ?, 0, 0)",
                          (int(start_ms * MS), int(end_ms * MS), device, corr, gpid(pid)))

    def close(self):
        self.conn.commit()
        self.conn.close()
        return self.path




def step_db(path, foreign=True):
    """One OPSD-like step in domain ``opsd`` of process 100 (see the expected figures below)."""
    db = Db(path)
    db.domain(1, "opsd")
    db.domain(2, "nccl")
    for name, start, end in [("opsd/step", 0, 100), ("opsd/rollout", 10, 60), ("opsd/prefill", 12, 20),
                             ("opsd/decode", 20, 30), ("opsd/decode", 30, 45), ("opsd/backward", 70, 90)]:
        db.push(name, start, end, domain=1)
    db.nvtx(60, 65 * MS, 68 * MS, "opsd/logit_cache", domain=1)  # a start/end range
    db.launches = [
        (RUNTIME, 13, 1, MAIN, KERNEL, 14, 16),    # prefill: 2 ms
        (DRIVER, 25, 2, MAIN, MEMCPY, 26, 27),     # decode 1: 1 ms (driver API launch)
        (RUNTIME, 31, 4, MAIN, KERNEL, 32, 35),    # decode 2: union [32, 36] = 4 ms
        (RUNTIME, 32, 5, MAIN, KERNEL, 34, 36),
        (RUNTIME, 75, 3, AUTOGRAD, MEMSET, 76, 76.5),  # backward, launched from another thread
    ]
    for api, at, corr, tid, table, g0, g1 in db.launches:
        db.api(api, at, corr, tid=tid)
        db.gpu(table, g0, g1, corr)
    if foreign:
        db.nvtx(34, 66 * MS, None, "opsd/loss", domain=1)                   # a marker: not a range
        db.push("opsd/optimizer_step", 95, None, domain=1)                   # never closed
        db.push("opsd/decode", 46, 47, domain=2)                             # our name, other domain
        db.push("forward", 61, 65, registered=False)                         # default domain, text
        db.domain(1, "other", pid=OTHER_PID)                                 # domain ids are per process
        db.push("opsd/step", 0, 50, pid=OTHER_PID, tid=5, domain=1)
        db.api(RUNTIME, 13.5, 1, pid=OTHER_PID, tid=5)                       # same correlation id 1
        db.gpu(KERNEL, 40, 48, 1, pid=OTHER_PID)
    return db.close()


def _rows(path, prefix=S.PREFIX, domain="opsd"):
    loaded = load([path], lambda p: read_trace(p, nvtx_domain=domain))
    return {r.name: r for r in build_report(loaded, prefix).stages}, loaded


def test_global_ids_decode_as_documented():
    assert (pid_of(gtid(PID, 7)), tid_of(gtid(PID, 7))) == (PID, 7)
    assert pid_of(gpid(OTHER_PID)) == OTHER_PID
    assert pid_of(None) == 0 and tid_of(None) == 0


def test_stages_nesting_and_self_time(tmp_path):
    rows, loaded = _rows(step_db(tmp_path / "a.sqlite"))
    assert list(rows) == ["opsd/step", "opsd/rollout", "opsd/prefill", "opsd/decode", "opsd/logit_cache",
                          "opsd/backward"]
    expected_cpu = {"opsd/step": 100, "opsd/rollout": 50, "opsd/prefill": 8, "opsd/decode": 25,
                    "opsd/logit_cache": 3, "opsd/backward": 20}
    assert {k: r.cpu_ms.total for k, r in rows.items()} == pytest.approx(expected_cpu)
    assert rows["opsd/decode"].count == 2
    assert rows["opsd/rollout"].self_ms == pytest.approx(50 - 8 - 25)
    assert rows["opsd/step"].self_ms == pytest.approx(100 - 50 - 3 - 20)
    assert rows["opsd/rollout"].share == pytest.approx(0.5)
    assert rows["opsd/step"].peak_allocated_mib is None  # no allocator samples in an nsys export
    assert loaded.warnings == [f"{loaded.files[0].path}: skipped 1 bad event: 1 with no end (range still open) "
                               "(first: 'opsd/optimizer_step' at ts 95000.0)"]  # the open range


def test_gpu_projection_through_runtime_and_driver_launches(tmp_path):
    rows, _ = _rows(step_db(tmp_path / "a.sqlite"))
    gpu = {k: r.gpu_ms.total for k, r in rows.items()}
    # prefill 2 ms; decodes 1 ms (driver launch, memcpy) + union 4 ms; backward 0.5 ms memset launched
    # on the autograd thread; the other process's kernel with the same correlation id is not ours.
    assert gpu == pytest.approx({"opsd/step": 7.5, "opsd/rollout": 7.0, "opsd/prefill": 2.0, "opsd/decode": 5.0,
                                 "opsd/logit_cache": 0.0, "opsd/backward": 0.5})
    assert rows["opsd/decode"].gpu_span_ms == pytest.approx(1.0 + 4.0)
    assert rows["opsd/decode"].gpu_ms.max == pytest.approx(4.0)


@pytest.mark.parametrize("domain, prefix, expected", [
    ("opsd", S.PREFIX, {"opsd/step": 1, "opsd/decode": 2}),
    (None, S.PREFIX, {"opsd/step": 2, "opsd/decode": 3}),          # nccl's opsd/decode, other pid's step
    ("nccl", S.PREFIX, {"opsd/decode": 1}),
    ("", "", {"forward": 1}),                                       # the default domain
    (None, "", {"opsd/step": 2, "opsd/decode": 3, "forward": 1}),
])
def test_domain_filter_and_prefix(tmp_path, domain, prefix, expected):
    rows, _ = _rows(step_db(tmp_path / "a.sqlite"), prefix=prefix, domain=domain)
    assert {k: rows[k].count for k in expected if k in rows} == expected


def test_markers_and_open_ranges_are_not_ranges(tmp_path):
    names = [ev[1] for ev in read_nsys_sqlite(step_db(tmp_path / "a.sqlite"), "opsd") if ev[0] == RANGE]
    assert "opsd/loss" not in names and "opsd/optimizer_step" not in names
    assert names.count("opsd/logit_cache") == 1


def _chrome_twin(path, db_path):
    """The same step as a Chrome trace (µs), from the rows of the database itself."""
    conn = sqlite3.connect(db_path)
    events = [annotation(name, start / 1000, (end - start) / 1000, pid=PID, tid=tid_of(g))
              for start, end, name, g in conn.execute(
                  "SELECT e.start, e.end, COALESCE(e.text, s.value), e.globalTid FROM NVTX_EVENTS e "
                  "LEFT JOIN StringIds s ON s.id = e.textId WHERE e.eventType IN (59, 60)")]
    for table, driver in ((RUNTIME, False), (DRIVER, True)):
        events += [launch(s / 1000, c, pid=PID, tid=tid_of(g), driver=driver)
                   for s, c, g in conn.execute(f"SELECT start, correlationId, globalTid FROM {table}")]
    for table, cat in ((KERNEL, "kernel"), (MEMCPY, "gpu_memcpy"), (MEMSET, "gpu_memset")):
        events += [gpu_op(s / 1000, (e - s) / 1000, c, cat=cat)
                   for s, e, c in conn.execute(f"SELECT start, end, correlationId FROM {table}")]
    conn.close()
    return write_events(str(path), events)


def test_same_report_as_the_chrome_source(tmp_path):
    db_path = step_db(tmp_path / "rank0.sqlite", foreign=False)
    chrome_path = _chrome_twin(tmp_path / "rank0.pt.trace.json", db_path)
    assert sum(1 for ev in read_chrome_trace(chrome_path) if ev[0] == RANGE) == 7
    nsys = build_report(load([db_path]), S.PREFIX).to_dict(by_rank=True)
    chrome = build_report(load([chrome_path]), S.PREFIX).to_dict(by_rank=True)
    nsys.pop("sources"), chrome.pop("sources")
    assert nsys == chrome


def test_minimal_schema_without_gpu_tables_or_strings(tmp_path):
    path = str(tmp_path / "min.sqlite")
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE NVTX_EVENTS (start INT NOT NULL, end INT, text TEXT, globalTid INT)")
    conn.executemany("INSERT INTO NVTX_EVENTS VALUES (?, ?, ?, ?)",
                     [(0, 10 * MS, "opsd/step", gtid(PID, MAIN)), (2 * MS, 5 * MS, "opsd/prefill", gtid(PID, MAIN))])
    conn.commit()
    conn.close()
    rows, _ = _rows(path, domain=None)
    assert rows["opsd/step"].self_ms == pytest.approx(7.0)
    assert rows["opsd/step"].gpu_ms is None  # no GPU activity at all


def test_gpu_tables_without_global_pid_join_on_correlation(tmp_path):
    schema = SCHEMA.replace("correlationId INT, globalPid INT,", "correlationId INT,")
    db = Db(tmp_path / "old.sqlite", schema=schema)
    db.push("opsd/decode", 0, 10)
    db.api(RUNTIME, 1, 9)
    db.conn.execute(f"INSERT INTO {KERNEL} VALUES (?, ?, 0, 1, 7, 9, 0, 0)", (2 * MS, 5 * MS))
    rows, _ = _rows(db.close(), domain=None)
    assert rows["opsd/decode"].gpu_ms.total == pytest.approx(3.0)


def _cli(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, [line for line in err.splitlines() if line]


def test_cli_accepts_sqlite_and_the_domain_flag(tmp_path, capsys):
    path = step_db(tmp_path / "rank3.sqlite")
    code, out, err = _cli(capsys, path, "--format", "json", "--nvtx-domain", "opsd", "--by-rank")
    doc = json.loads(out)
    assert code == 0 and doc["ranks"] == [3] and doc["straggler"]["opsd/decode"] == 3
    assert {s["name"]: s["count"] for s in doc["stages"]}["opsd/decode"] == 2
    assert len(err) == 1 and err[0].startswith(f"warning: {path}: skipped 1 bad event: 1 with no end")
    code, out, _ = _cli(capsys, path, "--format", "json")
    assert code == 0 and {s["name"]: s["count"] for s in json.loads(out)["stages"]}["opsd/decode"] == 3


@pytest.mark.parametrize("make, problem", [
    (lambda p: p.write_bytes(b"this is not a database at all" * 10), "not an SQLite database"),
    (lambda p: p.write_bytes(b""), "empty file"),
    (lambda p: None, "no such file"),
    (lambda p: sqlite3.connect(p).execute("CREATE TABLE other (x INT)").connection.commit(),
     "no NVTX_EVENTS table"),
])
def test_cli_bad_sqlite_is_one_line_exit_2(tmp_path, capsys, make, problem):
    path = tmp_path / "bad.sqlite"
    make(path)
    existed = path.exists()
    code, out, err = _cli(capsys, path)
    assert code == 2 and out == ""
    assert len(err) == 1 and err[0].startswith(f"error: {path}: ") and problem in err[0]
    assert path.exists() == existed  # never created by opening


def test_cli_truncated_database_is_one_line_exit_2(tmp_path, capsys):
    path = step_db(tmp_path / "t.sqlite")
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 3])
    code, _, err = _cli(capsys, path)
    assert code == 2 and len(err) == 1 and err[0].startswith(f"error: {path}: ")


def test_cli_reports_good_ranks_and_names_the_bad_file(tmp_path, capsys):
    good = step_db(tmp_path / "rank0.sqlite")
    bad = tmp_path / "rank1.sqlite"
    bad.write_bytes(os.urandom(64))
    code, out, err = _cli(capsys, good, bad, "--format", "json", "--nvtx-domain", "opsd")
    assert code == 2 and json.loads(out)["ranks"] == [0]
    assert [line for line in err if line.startswith("error:")] == [
        f"error: {bad}: not an SQLite database (expected an 'nsys export --type sqlite' file)"]

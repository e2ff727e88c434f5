"""opsd-summarize on the last bad inputs of issue 34: never silently wrong numbers, never a lost report.

Text after a trace's JSON document (``xyz``, a second document appended by ``cat``, in ``.json`` and inside
``.json.gz``), bytes appended after a gzip stream, a document cut short or invalid around its ``traceEvents``
array, a second ``traceEvents`` key, ``traceEvents`` that is not an array, a bare array without its ``]``, an
element that is not an object in the middle of the array, and flags that cannot act (``--nvtx-domain`` on
Chrome traces, a misspelt domain on an nsys export, ``--diff-wide`` without ``--diff``, ``--kernels`` with
CSV). Each case fails before its fix.

Guards, which held already and must go on holding: a document cut inside its array (or a bare array cut inside an
event) stays an error; gzip members and zero padding are still read (the gzip reader is new); ``--nvtx-domain``
with an nsys input is not warned; ``displayTimeUnit`` never scales ``ts``; a ``.json.gz`` holding plain JSON is
read; metadata after the array (with a ``}]`` of its own) gives no warning.
"""

import gzip
import json

import pytest

from instrumentation import stages as S
from tests.test_traces_nsys import step_db
from traces import textfile
from traces.cli import main
from traces.synth import annotation, gpu_op, launch

STEP, PREFILL = S.range_name(S.STEP), S.range_name(S.PREFILL)
#: One step of 100 us with a prefill of 20 us (rank 0).
GOOD = [annotation(STEP, 0, 100), annotation(PREFILL, 10, 20), launch(12, 1), gpu_op(15, 5, 1)]
#: A second document: two more steps and a stage of its own; counted, they would change every number.
OTHER = [annotation(STEP, 1000, 500), annotation(STEP, 2000, 500), annotation("opsd/other", 1000, 400)]


def _doc(events=GOOD, rank=0) -> str:
    return json.dumps({"schemaVersion": 1, "distributedInfo": {"rank": rank, "world_size": 2},
                       "traceEvents": events})


def _write(tmp_path, text: str, name="rank0.pt.trace.json", gz=False):
    path = tmp_path / (name + (".gz" if gz else ""))
    data = text.encode("utf-8")
    path.write_bytes(gzip.compress(data) if gz else data)
    return str(path)


def _run(capsys, *argv):
    """``(exit status, {stage: (count, cpu total ms)} or None, stderr lines)`` of ``--format json``."""
    code = main([*map(str, argv), "--format", "json"])
    out, err = capsys.readouterr()
    stages = {s["name"]: (s["count"], s["cpu_ms"]["total"]) for s in json.loads(out)["stages"]} if out else None
    return code, stages, err.splitlines()


#: The numbers of GOOD alone.
EXPECTED = {STEP: (1, pytest.approx(0.1)), PREFILL: (1, pytest.approx(0.02))}


@pytest.mark.parametrize("gz", [False, True], ids=["json", "json.gz"])
@pytest.mark.parametrize("after", ["xyz", "\nxyz\n", "second document", "second document after a newline"])
def test_text_after_the_document_is_ignored_with_one_warning(tmp_path, capsys, after, gz):
    good = _doc()
    extra = {"second document": _doc(OTHER), "second document after a newline": "\n" + _doc(OTHER)}.get(after, after)
    path = _write(tmp_path, good + extra, gz=gz)
    code, stages, err = _run(capsys, path)
    assert code == 0 and stages == EXPECTED  # the second document's steps are not counted
    where = f"byte {len(good):,}" + (" of the decompressed text" if gz else "")
    assert err == [f"warning: {path}: ignored {len(extra.encode()):,} bytes after the end of the JSON document at "
                   f"{where}" + (" (a second JSON document?)" if "second" in after else "") + ": "
                   + repr(extra.lstrip()[:40] + ("..." if len(extra.lstrip()) > 40 else ""))
                   + "; only the events of the document are used"]


@pytest.mark.parametrize("chunk_chars", [1 << 23, 64, 7])
def test_a_second_document_is_never_read_as_events_whatever_the_chunks(tmp_path, capsys, monkeypatch, chunk_chars):
    """The fast reader stops at the array's end: a second document's Kineto-layout events are not added."""
    monkeypatch.setattr(textfile, "CHUNK_CHARS", chunk_chars)
    good = _doc([annotation("opsd/é", 0, 100)] + GOOD[1:])  # a non-ASCII name: offsets are bytes
    second = json.dumps({"traceEvents": OTHER + [launch(1100, 9), gpu_op(1110, 50, 9)]}, indent=2)
    path = _write(tmp_path, good + second)
    code, stages, err = _run(capsys, path)
    assert code == 0 and stages == {"opsd/é": (1, pytest.approx(0.1)), PREFILL: (1, pytest.approx(0.02))}
    assert len(err) == 1 and f"at byte {len(good.encode()):,} (a second JSON document?)" in err[0]


@pytest.mark.parametrize("last", ["an object", "not an object"])
def test_a_bare_array_followed_by_another_is_read_once(tmp_path, capsys, last):
    first = json.dumps(GOOD + ([] if last == "an object" else [7]))
    path = _write(tmp_path, first + json.dumps(OTHER))
    code, stages, err = _run(capsys, path)
    assert code == 0 and stages == EXPECTED
    assert f"warning: {path}: ignored {len(json.dumps(OTHER)):,} bytes after the end of the JSON document at byte " \
           f"{len(first):,} (a second JSON document?)" in err[0]
    assert err[1:] == ([] if last == "an object" else
                       [f"warning: {path}: skipped 1 bad event: 1 with element not an object (first: 7)"])


def test_an_element_that_is_not_an_object_amid_the_events_is_counted(tmp_path, capsys):
    """Amid the events (not first), it was skipped without a word; it is a bad event like one first in the array."""
    pieces = [json.dumps(GOOD[0]), "7", '"x"'] + [json.dumps(e) for e in GOOD[1:]]
    text = '{"traceEvents": [' + ", ".join(pieces) + "]}"
    path = _write(tmp_path, text)
    code, stages, err = _run(capsys, path)
    assert code == 0 and stages == EXPECTED
    assert err == [f"warning: {path}: skipped 2 bad events: 2 with element not an object (first: 7)"]


def test_bytes_appended_after_the_gzip_data_are_ignored_with_one_warning(tmp_path, capsys):
    good = _doc()
    compressed = gzip.compress(good.encode())
    path = tmp_path / "rank0.pt.trace.json.gz"
    path.write_bytes(compressed + b"junk!" + b"\0" * 3)  # was: the whole file refused as a corrupt gzip
    code, stages, err = _run(capsys, path)
    assert code == 0 and stages == EXPECTED
    assert err == [f"warning: {path}: ignored 8 bytes after the end of the gzip data (at byte {len(compressed):,} of "
                   f"the file): not gzip; the {len(good):,} bytes of text before them are read"]


def test_zero_padding_and_a_second_gzip_member_are_still_read(tmp_path, capsys):
    """What gzip itself allows: members one after the other, zero bytes between them."""
    good = _doc()
    path = tmp_path / "rank0.pt.trace.json.gz"
    path.write_bytes(gzip.compress(good[:50].encode()) + b"\0" * 7 + gzip.compress(good[50:].encode()) + b"\0" * 5)
    code, stages, err = _run(capsys, path)
    assert (code, stages, err) == (0, EXPECTED, [])


@pytest.mark.parametrize("gz", [False, True], ids=["json", "json.gz"])
@pytest.mark.parametrize("cut", ["the closing brace", "inside the metadata after the array"])
def test_a_document_cut_short_after_its_array_is_warned(tmp_path, capsys, cut, gz):
    full = json.dumps({"traceEvents": GOOD, "distributedInfo": {"rank": 0}})
    text = full[:-1] if cut == "the closing brace" else full[:-8]
    path = _write(tmp_path, text, gz=gz)
    code, stages, err = _run(capsys, path)
    assert code == 0 and stages == EXPECTED
    where = f"byte {len(text):,}" + (" of the decompressed text" if gz else "")
    assert err == [f"warning: {path}: the JSON document is cut short: it ends at {where} without closing the object "
                   "after the traceEvents array (truncated?); the array's events are used"]


def test_a_document_cut_inside_its_array_is_still_an_error(tmp_path, capsys):
    """Today's handling, kept: a clear error naming the file."""
    good = _write(tmp_path, _doc())
    cut = _write(tmp_path, _doc(GOOD, rank=1)[:-30], name="rank1.pt.trace.json")
    code, stages, err = _run(capsys, good, cut)
    assert code == 2 and stages == EXPECTED
    assert err == [f"error: {cut}: truncated JSON (traceEvents array not closed)"]


def test_invalid_json_around_the_array_is_warned(tmp_path, capsys):
    events = json.dumps(GOOD)
    after = _write(tmp_path, '{"traceEvents": %s, "distributedInfo": {"rank": 0} xyz}' % events)
    before = _write(tmp_path, '{"distributedInfo": {"rank": 1} xyz, "traceEvents": %s}' % events,
                    name="rank1.pt.trace.json")
    code, stages, err = _run(capsys, after, before)
    assert code == 0 and stages == {STEP: (2, pytest.approx(0.2)), PREFILL: (2, pytest.approx(0.04))}
    at = len('{"traceEvents": %s, "distributedInfo": {"rank": 0} ' % events)
    assert err == [f"warning: {after}: invalid JSON after the traceEvents array at byte {at:,} (near 'xyz}}'): the "
                   "metadata after the array is not read; the array's events are used",
                   f"warning: {before}: invalid JSON before the traceEvents array at byte 32 (near 'xyz, '): the "
                   "metadata there (distributedInfo) is not read; the events are read"]


def test_a_second_trace_events_key_is_warned(tmp_path, capsys):
    """JSON readers keep the last of two keys, this reader the first: the ambiguity is said, not hidden."""
    path = _write(tmp_path, '{"traceEvents": %s, "traceEvents": %s}' % (json.dumps(GOOD), json.dumps(OTHER)))
    code, stages, err = _run(capsys, path)
    assert code == 0 and stages == EXPECTED
    assert err == [f"warning: {path}: a second traceEvents key after the array: ignored (only the first array is read)"]


@pytest.mark.parametrize("value, kind", [({"a": GOOD}, "an object"), (None, "null"), ("x", "a string")])
def test_trace_events_not_an_array_is_named(tmp_path, capsys, value, kind):
    path = _write(tmp_path, json.dumps({"traceEvents": value}))
    code, stages, err = _run(capsys, path)
    assert code == 2 and stages is None
    assert err == [f"error: {path}: traceEvents is {kind}, not an array of events (not a Chrome trace)"]


@pytest.mark.parametrize("end", ["", ",", ",\n"])
def test_a_bare_array_without_its_bracket_is_read(tmp_path, capsys, end):
    """The Trace Event Format lets the JSON Array Format end without ``]`` (a writer that may crash): read, said."""
    text = json.dumps(GOOD)[:-1] + end
    path = _write(tmp_path, text)
    code, stages, err = _run(capsys, path)
    assert code == 0 and stages == EXPECTED
    assert err == [f"warning: {path}: the JSON array ends at byte {len(text):,} without its closing ']' (allowed by "
                   "the Trace Event Format, or the file was cut short): its events are used"]


def test_a_bare_array_cut_inside_an_event_is_still_an_error(tmp_path, capsys):
    path = _write(tmp_path, json.dumps(GOOD)[:-20])
    code, stages, err = _run(capsys, path)
    assert code == 2 and stages is None
    assert err == [f"error: {path}: truncated JSON (traceEvents array not closed)"]


def test_nvtx_domain_on_chrome_traces_is_warned_once(tmp_path, capsys):
    first = _write(tmp_path, _doc())
    second = _write(tmp_path, _doc(GOOD, rank=1), name="rank1.pt.trace.json")
    code, stages, err = _run(capsys, first, second, "--nvtx-domain", "opsd", "--diff", first)
    assert code == 0 and stages == {STEP: (2, pytest.approx(0.2)), PREFILL: (2, pytest.approx(0.04))}
    assert err == ["warning: --nvtx-domain 'opsd' applies to Nsight Systems exports (.sqlite) only, and no input is "
                   "one (Chrome / TensorBoard traces): ignored"]


def test_nvtx_domain_with_an_nsys_input_is_not_warned(tmp_path, capsys):
    chrome = _write(tmp_path, _doc())
    nsys = step_db(tmp_path / "rank1.sqlite")
    code, stages, err = _run(capsys, chrome, nsys, "--nvtx-domain", "opsd")
    assert code == 0 and stages[STEP][0] == 2
    assert not any("--nvtx-domain" in line for line in err)


def test_an_nvtx_domain_absent_from_an_export_is_warned(tmp_path, capsys):
    """A misspelt domain left every range of the export out: its rank vanished from the report without a word."""
    chrome = _write(tmp_path, _doc())
    nsys = step_db(tmp_path / "rank1.sqlite")
    code, stages, err = _run(capsys, chrome, nsys, "--nvtx-domain", "opds")
    assert code == 0 and stages == EXPECTED
    assert f"warning: {nsys}: --nvtx-domain 'opds': no NVTX range of that domain here, only of the default domain, " \
           "'nccl', 'opsd', 'other': every range left out" in err


@pytest.mark.parametrize("flags, warning", [
    (["--diff-wide"], "warning: --diff-wide applies with --diff only: ignored"),
    (["--kernels", "3", "--format", "csv"],
     "warning: --kernels 3: the CSV output has no kernel lists (use --format table, markdown or json): ignored"),
])
def test_flags_that_cannot_act_are_warned(tmp_path, capsys, flags, warning):
    path = _write(tmp_path, _doc())
    assert main([path, *flags]) == 0
    out, err = capsys.readouterr()
    assert STEP in out and err.splitlines() == [warning]


def test_guard_display_time_unit_never_scales_ts(tmp_path, capsys):
    """``displayTimeUnit`` says how a viewer shows times; ``ts`` / ``dur`` stay microseconds (Trace Event Format)."""
    for unit in ("ns", "ms"):
        doc = json.loads(_doc())
        doc["displayTimeUnit"] = unit
        path = _write(tmp_path, json.dumps(doc), name=f"{unit}.json")
        assert _run(capsys, path) == (0, EXPECTED, [])


def test_guard_a_json_gz_holding_plain_json_is_read(tmp_path, capsys):
    path = _write(tmp_path, _doc(), name="rank0.pt.trace.json.gz")  # named .gz, not compressed
    assert _run(capsys, path) == (0, EXPECTED, [])


def test_guard_a_good_trace_with_metadata_after_its_array_has_no_warning(tmp_path, capsys):
    text = '{"traceEvents": %s, "schemaVersion": 1, "x": [{"a": 1}, {"b": [2]}]}\n\n' % json.dumps(GOOD, indent=2)
    assert _run(capsys, _write(tmp_path, text)) == (0, EXPECTED, [])


@pytest.mark.parametrize("where", ["before", "after"])
def test_metadata_too_large_to_keep_is_warned(tmp_path, capsys, monkeypatch, where):
    """Metadata past the limit was dropped without a word (``distributedInfo.rank`` with it)."""
    from traces import chrome_tail

    monkeypatch.setattr(chrome_tail, "MAX_HEADER_CHARS", 1 << 20)
    big = '"deviceProperties": "%s"' % ("x" * (1 << 20))
    events = json.dumps(GOOD)
    text = '{%s, "traceEvents": %s}' % (big, events) if where == "before" else \
        '{"traceEvents": %s, %s}' % (events, big)
    path = _write(tmp_path, text)
    code, stages, err = _run(capsys, path)
    assert code == 0 and stages == EXPECTED
    assert err == [f"warning: {path}: " + ("over 1 M characters of metadata before the traceEvents array: not read "
                                           "(distributedInfo with it)" if where == "before" else
                                           f"over 1 M characters after the traceEvents array (from byte "
                                           f"{len(events) + 16:,}): not read as metadata; the array's events are "
                                           "used")]

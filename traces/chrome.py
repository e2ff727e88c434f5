"""Streaming reader of Chrome-trace JSON (``.json`` / ``.json.gz``) as written by torch.profiler.

The document is never loaded whole. Decompressed text is read in chunks; one regex search per
chunk finds the events of the few categories the report needs, and nothing else is decoded. A
kept event is traced back to its opening brace, trusted when the braces before it balance, and
read by an anchored regex when it has Kineto's layout (else decoded by the JSON scanner); where a
start cannot be trusted (unbalanced braces inside strings, the end of the array) events are
decoded exactly with ``json.JSONDecoder.raw_decode`` up to the next chunk. Results are the tuples
of :mod:`traces.events`. Top-level keys before and after the array are read as metadata
(``distributedInfo.rank``), and what follows the document is checked (:mod:`traces.chrome_tail`). The
fast pass never reads past the array's end: a ``}]`` whose braces balance stops it (a second document
appended to the file is not read as more events), as does an element that is not an object (decoded exactly,
and counted as a bad event).
"""

from __future__ import annotations

import json
import re
from typing import Iterator

from traces import textfile
from traces.bad import BAD, example
from traces.chrome_event import decoded_tuple, fast_tuple
from traces.chrome_tail import after_events, find_events_array
from traces.events import META, TraceError

_BOUNDARY = re.compile(r"\}\s*,\s*\{")
#: An object followed by the end of its array, or by an element that is not an object.
_OBJECT_THEN_OTHER = re.compile(r"\}\s*(?:\]|,\s*[^\s{])")
_WS = re.compile(r"\s*")
_decoder = json.JSONDecoder()
_scan_once = _decoder.scan_once
#: Categories the report keeps, found by one regex over a chunk (``[memory]`` by name).
_KEEP_CAT = re.compile(r'"cat":\s*"(?:kernel|gpu_memcpy|gpu_memset|cuda_runtime|cuda_driver|'
                       r'user_annotation|cpu_op|Trace)"')


def read_chrome_trace(path: str) -> Iterator[tuple]:
    """Yield the event tuples of a Chrome-trace file (an :class:`~traces.events.EventSource`).

    Raises :class:`TraceError` for an empty file, non-JSON text, a truncated or corrupt gzip, a
    document without a ``traceEvents`` array, or an array that is not closed (but a bare array, which the
    Trace Event Format lets end without its ``]``: its events are read, with a note).
    """
    chunks = textfile.chunks(path, textfile.open_text(path))
    head = ""
    for chunk in chunks:  # leading whitespace is dropped chunk by chunk, never held
        head = chunk.lstrip()
        if head:
            break
    if not head:
        raise TraceError(path, "empty file")
    if head[0] == "[":  # the JSON Array Format: a bare list of events
        try:
            rest = yield from _scan_events(path, chunks, head, 1)
        except _Unclosed:
            yield from ((META, "note", n) for n in chunks.notes)
            yield (META, "note", f"the JSON array ends at {chunks.at(chunks.offset)} without its closing ']' "
                                 "(allowed by the Trace Event Format, or the file was cut short): its events are used")
            return
        yield from after_events(chunks, rest, bare=True)
        return
    if head[0] != "{":
        raise TraceError(path, "not JSON (expected an object with traceEvents)")
    buf, pos = yield from find_events_array(path, chunks, head)
    rest = yield from _scan_events(path, chunks, buf, pos)
    yield from after_events(chunks, rest, bare=False)


class _Unclosed(TraceError):
    """The text ended after a complete element of the array, before its ``]``."""


def _last_boundary(buf: str, pos: int, hi: int | None = None) -> int:
    """Start of the last event of ``buf[pos:hi]`` that follows a ``}, {`` cut (``pos`` if none)."""
    hi = len(buf) if hi is None else hi
    lo = max(pos, hi - (1 << 16))
    while True:
        last = None
        for last in _BOUNDARY.finditer(buf, lo, hi):
            pass
        if last is not None or lo == pos:
            return last.end() - 1 if last is not None else pos
        lo = max(pos, lo - (1 << 20))


def _array_end(buf: str, pos: int, hi: int) -> int:
    """Position of the ``}`` closing the array's last object, or the object before an element that is not one,
    in ``buf[pos:hi]`` (``pos``: an element's start); -1 if none. The first ``}]`` (``}, 7``) whose braces
    balance from ``pos`` (one inside an event does not)."""
    depth, at = 0, pos
    for m in _OBJECT_THEN_OTHER.finditer(buf, pos, hi):
        end = m.start() + 1
        depth += buf.count("{", at, end) - buf.count("}", at, end)
        at = end
        if depth == 0:
            return m.start()
    return -1


def _fast_pass(buf: str, pos: int):
    """Kept event tuples of the complete events of ``buf[pos:]``, without cutting skipped events.

    Each kept marker is traced back to the ``{`` that opens its event; that start is trusted when
    the braces between the previous trusted start and it balance (no unmatched brace inside a
    string). Returns ``(tuples, next_pos, exact)``: ``next_pos`` is the first event not handled:
    the last, possibly incomplete one, or, when ``exact``, the first one to decode exactly (the last
    event before the end of the array, when it lies in ``buf``).
    """
    last = _last_boundary(buf, pos)
    end = _array_end(buf, pos, last)
    if end >= 0:
        last = _last_boundary(buf, pos, end)
    out, checked, prev = [], pos, -1
    count, append, rfind = buf.count, out.append, buf.rfind
    for at in _kept_positions(buf, pos, last):
        s = rfind("{", checked, at)
        if s <= prev:
            continue
        if count("{", checked, s) != count("}", checked, s):
            return out, _after(buf, checked, prev), True
        checked = prev = s
        tup = fast_tuple(buf, s)
        if tup is None:
            try:
                tup = decoded_tuple(_scan_once(buf, s)[0])
            except (StopIteration, ValueError):
                return out, s, True
            except RecursionError:
                tup = _too_deep(buf, s)
            if tup is None:
                continue
        append(tup)
    if count("{", checked, last) != count("}", checked, last):
        return out, _after(buf, checked, prev), True
    return out, last, end >= 0


def _after(buf: str, start: int, handled: int) -> int:
    """Where exact decoding resumes: ``start``, or past the event there when already handled."""
    return _end_of_value(buf, start) if start == handled else start


#: Strings (possibly cut by the end of the buffer) and brackets, for skipping deep values.
_TOKEN = re.compile(r'"(?:[^"\\]++|\\.)*+"?|[{}\[\]]')
_NAME_NEAR = re.compile(r'"name":\s*"((?:[^"\\]|\\.){0,200})"')
_TS_NEAR = re.compile(r'"ts":\s*(-?[\d.]+(?:[eE][-+]?\d+)?)')


def _end_of_value(buf: str, start: int) -> int:
    """End of the JSON value at ``buf[start]`` (a deep one too); -1 when it is cut off."""
    try:
        return _decoder.raw_decode(buf, start)[1]
    except RecursionError:
        return _skip_deep(buf, start)


def _skip_deep(buf: str, start: int) -> int:
    """End of the JSON object or array at ``buf[start]`` without recursion; -1 when it is cut off."""
    depth = 0
    for m in _TOKEN.finditer(buf, start):
        token = m.group()
        if token[0] == '"':
            if len(token) == 1 or token[-1] != '"':  # a string cut by the end of the buffer
                return -1
            continue
        depth += 1 if token in "{[" else -1
        if depth == 0:
            return m.end()
    return -1


def _too_deep(buf: str, s: int) -> tuple:
    """The BAD tuple of an event nested too deeply for the JSON decoder (named from its text)."""
    head = buf[s:s + 4096]
    name, ts = _NAME_NEAR.search(head), _TS_NEAR.search(head)
    try:
        start = float(ts.group(1)) if ts else None
    except ValueError:
        start = None
    return (BAD, "nesting too deep to decode", example(name.group(1) if name else None, start))


def _kept_positions(buf: str, lo: int, hi: int) -> list[int]:
    """Sorted positions of the kept-category markers in ``buf[lo:hi]``."""
    found = [m.start() for m in _KEEP_CAT.finditer(buf, lo, hi)]
    at = buf.find('"[memory]"', lo, hi)
    if at >= 0:
        while at >= 0:
            found.append(at)
            at = buf.find('"[memory]"', at + 1, hi)
        found.sort()
    return found


def _scan_events(path, chunks, buf, pos):
    """Yield tuples of the kept events of the array starting at ``buf[pos:]``; return the text after it.

    Complete events are handled by :func:`_fast_pass`; where a cut cannot be verified (braces in
    strings, the end of the array) events are decoded exactly, one by one, up to the next chunk.
    """
    at_eof, force_exact = False, False
    while True:
        pos = _WS.match(buf, pos).end()
        if buf.startswith(",", pos):
            pos = _WS.match(buf, pos + 1).end()
        if buf.startswith("]", pos):
            return buf[pos + 1:]
        if not at_eof and not force_exact and buf.startswith("{", pos):
            tuples, nxt, exact = _fast_pass(buf, pos)
            yield from tuples
            if not exact and nxt > pos:
                nxt_chunk = next(chunks, None)
                at_eof = nxt_chunk is None
                buf, pos = buf[nxt:] + (nxt_chunk or ""), 0
                continue
            pos, force_exact = nxt, True
            continue
        force_exact = False
        pos, buf, at_eof = yield from _exact_pass(path, chunks, buf, pos, at_eof)


_DEEP = object()
#: First characters of a JSON value: an element of the array that is not an object is skipped as a bad event.
_VALUE_START = frozenset('{["-0123456789tfn')


def _element_tuple(obj, buf: str, pos: int, end: int):
    """The tuple of a decoded array element: its event's, None for metadata, BAD for a non-object."""
    if isinstance(obj, dict):
        return decoded_tuple(obj) if obj.get("ph") != "M" else None
    text = buf[pos:min(end, pos + 41)]
    return (BAD, "element not an object", text if len(text) <= 40 else text[:36] + " ...")


def _decode_one(buf: str, pos: int):
    """``(object, end)`` of the value at ``buf[pos]``: ``(None, -1)`` when it is cut off or not JSON,
    ``(_DEEP, end)`` when it is nested too deeply for the decoder (``end`` -1 when cut off)."""
    try:
        return _decoder.raw_decode(buf, pos)
    except ValueError:
        return None, -1
    except RecursionError:
        return _DEEP, _skip_deep(buf, pos)


def _exact_pass(path, chunks, buf, pos, at_eof):
    """Decode events exactly from ``buf[pos]`` to the end of ``buf`` (or of the array)."""
    while True:
        if buf.startswith("]", pos):
            return pos, buf, at_eof
        if pos < len(buf) and buf[pos].isspace():
            pos = _WS.match(buf, pos).end()
            continue
        if pos >= len(buf) or buf[pos] not in _VALUE_START:
            if pos >= len(buf) and not at_eof:
                nxt = next(chunks, None)
                at_eof = nxt is None
                buf, pos = buf[pos:] + (nxt or ""), 0
                if nxt is not None:
                    return 0, buf, at_eof
                continue
            if pos >= len(buf):
                raise _Unclosed(path, "truncated JSON (traceEvents array not closed)")
            raise TraceError(path, f"invalid JSON in traceEvents near {buf[pos:pos + 40]!r}")
        obj, end = _decode_one(buf, pos)
        if end < 0 or end == len(buf):
            nxt = None if at_eof else next(chunks, None)
            if nxt is None:
                if end < 0:
                    raise TraceError(path, "truncated JSON (traceEvents array not closed)")
                at_eof = True
            else:
                buf, pos = buf[pos:] + nxt, 0
                continue
        tup = _too_deep(buf, pos) if obj is _DEEP else _element_tuple(obj, buf, pos, end)
        if tup is not None:
            yield tup
        pos = _WS.match(buf, end).end()
        if buf.startswith(",", pos):
            pos = _WS.match(buf, pos + 1).end()
            if pos >= len(buf) and not at_eof:
                continue

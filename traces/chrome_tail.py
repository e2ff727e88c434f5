"""The text around a Chrome trace's events: the top-level keys before and after the ``traceEvents``
array, read as metadata (``distributedInfo.rank``), and what follows the JSON document.

A document ends where its top-level object (or bare array) closes. Anything but whitespace after that
(``xyz``, a second document appended by ``cat``) is ignored: the document's events are used and one note
names the byte where the document ends and what follows. Metadata that is not valid JSON, a document cut
short after its array and a second ``traceEvents`` key are notes too, never a silent loss. Bytes are
counted in the (decompressed) UTF-8 text.
"""

from __future__ import annotations

import json
import re
from typing import Iterator

from traces.chrome_event import meta_tuples
from traces.events import META, TraceError
from traces.textfile import Chunks, utf8_len

#: Metadata before or after ``traceEvents`` larger than this is not kept (the array is still read).
MAX_HEADER_CHARS = 64 << 20

_EVENTS_KEY = re.compile(r'"traceEvents"\s*:\s*\[')
_decoder = json.JSONDecoder()
#: The object that the text after the array continues (its first key stands for the array).
_OPEN = '{"_": 0'
_SHOWN = 40


def _note(text: str) -> tuple:
    return (META, "note", text)


def _near(text: str, at: int) -> str:
    """Up to :data:`_SHOWN` characters of ``text`` from ``at``, quoted."""
    shown = text[at:at + _SHOWN + 1]
    return repr(shown if len(shown) <= _SHOWN else shown[:_SHOWN] + "...")


def _kind(value) -> str:
    return "null" if value is None else {dict: "an object", str: "a string", bool: "a boolean"}.get(
        type(value), "a number")


def find_events_array(path: str, chunks: Chunks, buf: str):
    """Find the ``traceEvents`` array of the object opening at ``buf[0]`` (the end of the text read so far);
    yield the tuples of the metadata before it; return ``(buf, pos)``, the array's content starting at
    ``buf[pos]``. :class:`TraceError` when there is no such array."""
    start = chunks.offset_of(buf)
    parts: list[str] = []
    size = 0
    while True:
        m = _EVENTS_KEY.search(buf)
        if m is not None:
            parts.append(buf[:m.start()])
            if size + m.start() <= MAX_HEADER_CHARS:
                yield from _header(chunks, "".join(parts), start)
            else:
                yield _note(f"over {MAX_HEADER_CHARS >> 20} M characters of metadata before the traceEvents array: "
                            "not read (distributedInfo with it)")
            return buf, m.end()
        cut = max(0, len(buf) - 64)
        keep = buf[cut:]
        if size <= MAX_HEADER_CHARS:
            parts.append(buf[:cut])
        size += cut
        nxt = next(chunks, None)
        if nxt is None:
            raise TraceError(path, _no_array("".join(parts) + keep if size <= MAX_HEADER_CHARS else None))
        buf = keep + nxt


def _no_array(text: str | None) -> str:
    """Why a document has no ``traceEvents`` array (``text``: the document, None when too large)."""
    if text is None:
        return "no traceEvents array (not a Chrome trace)"
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        return "not valid JSON (or truncated) and no traceEvents array"
    if isinstance(doc, dict) and "traceEvents" in doc:
        return f"traceEvents is {_kind(doc['traceEvents'])}, not an array of events (not a Chrome trace)"
    return "no traceEvents array (not a Chrome trace)"


def _header(chunks: Chunks, header: str, start: int) -> Iterator[tuple]:
    """The tuples of the metadata before the array (``header``: from the object's ``{`` to the key)."""
    try:
        meta = json.loads(header + '"_": 0}')
    except RecursionError:
        yield _note("metadata before the traceEvents array nested too deeply: not read")
        return
    except ValueError as exc:
        at = min(getattr(exc, "pos", 0), len(header))
        yield _note(f"invalid JSON before the traceEvents array at {chunks.at(start + utf8_len(header[:at]))} "
                    f"(near {_near(header, at if at < len(header) else max(0, at - _SHOWN))}): the metadata there "
                    "(distributedInfo) is not read; the events are read")
        return
    yield from meta_tuples(meta)


def after_events(chunks: Chunks, rest: str, bare: bool) -> Iterator[tuple]:
    """The tuples of the text after the events array (``rest``, then the chunks left, read to the end of the
    file): its metadata, and notes on what is ignored. ``bare``: the document is a bare array."""
    parts = [(chunks.offset_of(rest), rest)]
    size = len(rest)
    for chunk in chunks:  # whitespace-only chunks are dropped (2 GiB of spaces are never held)
        if size <= MAX_HEADER_CHARS and chunk.strip():
            parts.append((chunks.offset_of(chunk), chunk))
            size += len(chunk)
    yield from (_note(n) for n in chunks.notes)
    if size > MAX_HEADER_CHARS:
        yield _note(f"over {MAX_HEADER_CHARS >> 20} M characters after the traceEvents array (from "
                    f"{chunks.at(parts[0][0])}): not read as metadata; the array's events are used")
        return
    text = "".join(t for _, t in parts)

    def where(i: int) -> int:  # the byte offset of text[i]; the end of the file from len(text) on
        if i >= len(text):
            return chunks.offset
        for offset, part in parts:
            if i <= len(part):
                return offset + utf8_len(part[:i])
            i -= len(part)
        return chunks.offset

    end = 0
    if not bare:
        end = yield from _object_end(text, lambda i: chunks.at(where(i)))
        if end is None:
            return
    tail = text[end:].lstrip()
    if tail:
        size = chunks.offset - where(end)
        second = " (a second JSON document?)" if tail[0] in "{[" else ""
        yield _note(f"ignored {size:,} byte{'s' if size != 1 else ''} after the end of the JSON document at "
                    f"{chunks.at(where(end))}{second}: {_near(tail, 0)}; only the events of the document are used")


def _object_end(text: str, where):
    """Yield the metadata of the keys after the array (``text``: what follows its ``]``); return where the
    top-level object ends in ``text``, None (with a note) when it does not close or is not valid JSON."""
    try:
        meta, end = _decoder.raw_decode(_OPEN + text)
    except RecursionError:
        yield _note("metadata after the traceEvents array nested too deeply: not read; the events are used")
        return None
    except ValueError as exc:
        doc, at = _OPEN + text, getattr(exc, "pos", 0)
        if at >= len(doc.rstrip()) or str(exc).startswith("Unterminated string"):
            yield _note(f"the JSON document is cut short: it ends at {where(len(text))} without closing the object "
                        "after the traceEvents array (truncated?); the array's events are used")
        else:
            at = max(0, at - len(_OPEN))
            yield _note(f"invalid JSON after the traceEvents array at {where(at)} (near {_near(text, at)}): the "
                        "metadata after the array is not read; the array's events are used")
        return None
    if "traceEvents" in meta:
        yield _note("a second traceEvents key after the array: ignored (only the first array is read)")
    yield from meta_tuples(meta)
    return end - len(_OPEN)

"""Reading trace files as text: gzip recognised by its magic bytes, decompressed text in chunks.

Only this module opens trace files for the Chrome-JSON source; every failure becomes a
:class:`~traces.events.TraceError` naming the file. :class:`Chunks` counts the bytes of the text it has
given out (``offset``, UTF-8), so that a message can name a byte of the (decompressed) text. A gzip file
is read member after member (as ``gzip`` reads it, zero padding between them allowed); bytes after the last
member that are not gzip (a file with data appended) end the text, with a note naming the byte where they
start, instead of losing the whole file.
"""

from __future__ import annotations

import io
import os
import zlib

from traces.events import TraceError

#: Characters of decompressed text read per chunk.
CHUNK_CHARS = 1 << 23
#: Compressed bytes read at a time, and the largest decompressed piece of one read.
_READ_BYTES = 1 << 20
_GZIP_MAGIC = b"\x1f\x8b"


def open_text(path: str) -> io.TextIOBase:
    """``path`` as UTF-8 text (gunzipped when it starts with the gzip magic bytes)."""
    try:
        raw = open(path, "rb")
    except FileNotFoundError:
        raise TraceError(path, "no such file") from None
    except IsADirectoryError:
        raise TraceError(path, "is a directory") from None
    except OSError as exc:
        raise TraceError(path, f"cannot open ({exc.strerror})") from None
    magic = raw.peek(2)[:2] if hasattr(raw, "peek") else b""
    if magic == _GZIP_MAGIC:
        return io.TextIOWrapper(io.BufferedReader(Gunzip(raw), _READ_BYTES), encoding="utf-8", errors="replace")
    return io.TextIOWrapper(raw, encoding="utf-8", errors="replace")


class Gunzip(io.RawIOBase):
    """The decompressed bytes of an open gzip file, member after member, at most one read's worth at a time
    (a small file of 2 GiB of spaces is never held whole). Data after a member that is neither another member
    nor zero padding ends the stream: ``trailing`` is then ``(offset, size)`` of that data in the file."""

    def __init__(self, raw):
        super().__init__()
        self._raw, self._z, self._in, self._read = raw, zlib.decompressobj(31), b"", 0
        self.trailing = None

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self._raw.close()
        super().close()

    def readinto(self, b) -> int:
        while self._z is not None and len(b):
            if self._z.eof:
                self._next_member()
                continue
            data = self._in or self._more()
            if not data:
                raise EOFError("Compressed file ended before the end-of-stream marker was reached")
            out = self._z.decompress(data, min(len(b), _READ_BYTES))
            self._in = self._z.unused_data if self._z.eof else self._z.unconsumed_tail
            if out:
                b[:len(out)] = out
                return len(out)
        return 0

    def _more(self) -> bytes:
        data = self._raw.read(_READ_BYTES)
        self._read += len(data)
        return data

    def _next_member(self) -> None:
        rest = self._in.lstrip(b"\0")
        while len(rest) < 2:
            more = self._more()
            if not more:
                break
            rest = (rest + more).lstrip(b"\0")
        self._in, self._z = rest, (zlib.decompressobj(31) if rest[:2] == _GZIP_MAGIC else None)
        if self._z is None and rest:
            start = self._read - len(rest)
            self.trailing = (start, os.fstat(self._raw.fileno()).st_size - start)


def utf8_len(text: str) -> int:
    """Bytes of ``text`` in UTF-8 (its length when ASCII, without encoding it)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


class Chunks:
    """The text of ``stream`` in pieces of :data:`CHUNK_CHARS` characters (an iterator; closes the stream at
    its end); ``offset`` is the bytes of text given out so far, ``notes`` what was left unread (data
    appended after a gzip stream), known once the text has ended."""

    def __init__(self, path: str, stream: io.TextIOBase):
        self.path, self._stream, self.offset, self.notes = path, stream, 0, []
        raw = getattr(getattr(stream, "buffer", None), "raw", None)
        self._gunzip = raw if isinstance(raw, Gunzip) else None

    def __iter__(self) -> "Chunks":
        return self

    def __next__(self) -> str:
        if self._stream.closed:
            raise StopIteration
        try:
            chunk = self._stream.read(CHUNK_CHARS)
        except (EOFError, zlib.error) as exc:
            self._stream.close()
            raise TraceError(self.path, f"truncated or corrupt gzip ({exc})") from None
        except OSError as exc:
            self._stream.close()
            raise TraceError(self.path, f"read error ({exc})") from None
        if not chunk:
            self._end()
            raise StopIteration
        self.offset += utf8_len(chunk)
        return chunk

    def at(self, offset: int) -> str:
        """``byte N`` (of the decompressed text, for a gzip file): where a message points."""
        return f"byte {offset:,}" + (" of the decompressed text" if self._gunzip is not None else "")

    def offset_of(self, rest: str) -> int:
        """Byte offset, in the text, of ``rest``: the end of the text given out so far."""
        return self.offset - utf8_len(rest)

    def _end(self) -> None:
        trailing = self._gunzip.trailing if self._gunzip is not None else None
        self._stream.close()
        if trailing is not None:
            start, size = trailing
            self.notes.append(f"ignored {size:,} byte{'s' if size != 1 else ''} after the end of the gzip data "
                              f"(at byte {start:,} of the file): not gzip; the {self.offset:,} bytes of text "
                              "before them are read")


def chunks(path: str, stream: io.TextIOBase) -> Chunks:
    """:class:`Chunks` of ``stream``."""
    return Chunks(path, stream)

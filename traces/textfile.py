"""Reading trace files as text: gzip recognised by its magic bytes, decompressed text in chunks.

Only this module opens trace files for the Chrome-JSON source; every failure becomes a
:class:`~traces.events.TraceError` naming the file.
"""

from __future__ import annotations

import gzip
import io
import zlib
from typing import Iterator

from traces.events import TraceError

#: Characters of decompressed text read per chunk.
CHUNK_CHARS = 1 << 23


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
    if magic == b"\x1f\x8b":
        return io.TextIOWrapper(gzip.GzipFile(fileobj=raw), encoding="utf-8", errors="replace")
    return io.TextIOWrapper(raw, encoding="utf-8", errors="replace")


def chunks(path: str, stream: io.TextIOBase) -> Iterator[str]:
    """The text of ``stream`` in pieces of :data:`CHUNK_CHARS` characters; closes it at the end."""
    try:
        with stream:
            while True:
                chunk = stream.read(CHUNK_CHARS)
                if not chunk:
                    return
                yield chunk
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise TraceError(path, f"truncated or corrupt gzip ({exc})") from None
    except OSError as exc:
        raise TraceError(path, f"read error ({exc})") from None

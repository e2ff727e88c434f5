"""What ``opsd-summarize`` writes to the console: stderr lines with printable paths and names, stdout that
never fails to encode."""

from __future__ import annotations

import sys

from traces.names import printable


def say(kind: str, text) -> None:
    """One stderr line: ``kind: text``, with paths and names made printable (a newline cannot fake a line)."""
    print(f"{kind}: {printable(str(text))}", file=sys.stderr)


def out(text: str) -> None:
    """``text`` to stdout; a character its encoding lacks (an ASCII locale) is written as an escape."""
    encoding = getattr(sys.stdout, "encoding", None) or "utf-8"
    sys.stdout.write(text.encode(encoding, "backslashreplace").decode(encoding))

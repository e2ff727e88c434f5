"""Values the tools read from their command lines, checked before any work (no torch): counts in ASCII digits
(:func:`parse_int_text`), and a path this process will write (:func:`output_problem`: one set of rules for the main
job's ``--json-out``, the benchmarks' result files and ``trim_trace.py``'s output, each of which words its own error
around the reason)."""

from __future__ import annotations

import os
import re
import stat
from typing import Optional

_INT_RE = re.compile(r"\s*[+-]?[0-9]{1,4000}\s*", re.ASCII)  # int() refuses more than 4,300 digits


def parse_int_text(text: str) -> Optional[int]:
    """The int ``text`` spells in ASCII digits (a sign and surrounding blanks allowed), else None: ``int()`` also reads
    other scripts' digits (``int('٣')`` is 3) and underscores (``int('1_0')`` is 10), which a command-line count
    should not."""
    return int(text) if isinstance(text, str) and _INT_RE.fullmatch(text) else None


def output_problem(path, *, source: Optional[str] = None, create_folder: bool = False) -> Optional[str]:
    """Why ``path`` cannot be a file this process writes, or None. Refused: a non-string, empty or blank path, a NUL
    character, a directory (also a name ending in a separator, ``.`` or ``..``), a block device or a socket (a
    character device or a named pipe is written where it is: ``instrumentation.export.write_atomic``), ``source``
    itself (the file being read, which the output would overwrite), and a folder that does not exist; with
    ``create_folder`` (the writer creates missing folders) the nearest existing ancestor must instead be a directory
    this process may write."""
    if not isinstance(path, str) or not path.strip():
        return "is empty"
    if "\0" in path:
        return "contains a NUL character"
    if os.path.isdir(path):
        return "is a directory"
    try:
        mode = os.stat(path).st_mode
    except OSError:
        mode = 0
    if stat.S_ISBLK(mode) or stat.S_ISSOCK(mode):
        return f"is a {'block device' if stat.S_ISBLK(mode) else 'socket'}, not a file"
    name = os.path.basename(path)
    if not name:
        return "ends in a separator (a directory)"
    if name in (".", ".."):
        return "names a directory"
    if source and os.path.exists(path) and os.path.exists(source) and os.path.samefile(path, source):
        return "is the source file (it would be overwritten)"
    folder = os.path.dirname(os.path.abspath(path))
    if not create_folder:
        return None if os.path.isdir(folder) else f"is in the folder {folder}, which does not exist"
    existing = folder
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"is under {existing}, which is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"is under {existing}, which is not writable"
    return None

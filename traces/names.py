"""Names made printable: what a trace names (stages, kernels, runs) reaches terminals and files as text.

A name may hold anything JSON or a file system allows: control characters (a newline would fake a table row, an
escape sequence would repaint the terminal), invisible direction overrides, or a lone surrogate (valid JSON,
``"\\ud800"``, that no UTF-8 output can encode). :func:`printable` writes each such character as its Python escape
(``\\n``, ``\\x1b``, ``\\ud800``, ``\\u202e``); names without one (every real name) are returned as they are, after
one regex search. The sources apply it once, where a name enters the report, so every output (table, Markdown,
CSV, JSON, plots, TensorBoard tags) shows the same, encodable name.
"""

from __future__ import annotations

import re

#: C0 and C1 controls, DEL, lone surrogates, line / paragraph separators and bidirectional overrides.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(m: re.Match) -> str:
    char = m.group()
    code = ord(char)
    return _SHORT.get(char) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def printable(name: str) -> str:
    """``name`` with every unprintable character escaped (see the module docstring)."""
    return name if _UNPRINTABLE.search(name) is None else _UNPRINTABLE.sub(_escape, name)


#: Longest stage name a terminal or Markdown table shows (JSON and CSV keep the full name).
MAX_SHOWN_CHARS = 80


def shown(name: str, width: int = MAX_SHOWN_CHARS) -> str:
    """``name`` cut to ``width`` characters with an ellipsis (for tables read by people)."""
    return name if len(name) <= width else name[:width - 1] + "…"

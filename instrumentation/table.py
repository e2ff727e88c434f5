"""The one text-table formatter of the project: aligned text, Markdown or CSV (no dependencies).

Every table the project prints goes through :func:`render`: the live per-stage timer table
(``instrumentation.format_stage_rows``), the trace report's stage rows
(:func:`traces.format.format_table`) and the before/after diff (:mod:`traces.diff`). It lives here,
in the package below ``traces``, so that both use it without ``instrumentation`` importing
``traces``; ``traces.table`` names the same objects. One behaviour everywhere:

- ``table``: each column as wide as its widest cell, two spaces between columns, the label columns
  (``Column.left``) left-aligned and the others right-aligned, a rule of dashes under the header;
- ``markdown``: a pipe table, ``---`` under label columns and ``---:`` under the others, ``|`` in a
  cell escaped;
- ``csv``: the column keys as header and the raw values (no rounding; empty for null);
- a null value (None) prints as ``-`` in text and Markdown; an optional title is the first line;
  the text always ends with a newline.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

FORMATS = ("table", "markdown", "csv")
#: How a null value prints in text and Markdown tables.
NULL = "-"


def fixed(decimals: int = 3, signed: bool = False) -> Callable[[Any], str]:
    """Formatter of numbers with ``decimals`` digits after the point (ints print as they are); ``signed``: every
    number with its sign and ``decimals`` digits (a change: ``+0.040``)."""
    if signed:
        return lambda v: f"{v:+.{decimals}f}"
    return lambda v: str(v) if isinstance(v, int) and not isinstance(v, bool) else f"{v:.{decimals}f}"


def percent(decimals: int = 1, signed: bool = False) -> Callable[[Any], str]:
    """Formatter of a fraction (0.25) as a percentage (``25.0%``; ``+25.0%`` when ``signed``)."""
    sign = "+" if signed else ""
    return lambda v: f"{100 * v:{sign}.{decimals}f}%"


@dataclass(frozen=True)
class Column:
    """One column of a table."""

    key: str
    """Header in CSV (a machine name such as ``cpu_total_ms``)."""
    title: str
    """Header in text and Markdown tables."""
    text: Callable[[Any], str] = str
    """Text of a non-null value in text and Markdown tables."""
    left: bool = False
    """Left-aligned (a label column) instead of right-aligned."""

    def __post_init__(self) -> None:
        if not self.key or not isinstance(self.key, str):
            raise ValueError(f"key must be a non-empty string; got {self.key!r}")
        if not isinstance(self.title, str):
            raise ValueError(f"title must be a string; got {self.title!r}")


def render(columns: Sequence[Column], rows: Sequence[Sequence[Any]], fmt: str = "table",
           title: Optional[str] = None) -> str:
    """``rows`` (one value per column) as a text, Markdown or CSV table (see the module docstring)."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {', '.join(FORMATS)}; got {fmt!r}")
    for row in rows:
        if len(row) != len(columns):
            raise ValueError(f"rows must have {len(columns)} values (one per column); got {len(row)}")
    if fmt == "csv":
        return _csv(columns, rows)
    cells = [[NULL if v is None else c.text(v) for c, v in zip(columns, row)] for row in rows]
    head = [c.title for c in columns]
    lines = [title] if title else []
    if fmt == "markdown":
        if title:
            lines.append("")
        lines += _markdown(columns, head, cells)
    else:
        lines += _aligned(columns, head, cells)
    return "\n".join(lines) + "\n"


def _csv(columns: Sequence[Column], rows) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([c.key for c in columns])
    for row in rows:
        writer.writerow(["" if v is None else v for v in row])
    return out.getvalue()


def _markdown(columns, head: list[str], cells: list[list[str]]) -> list[str]:
    esc = lambda text: text.replace("|", "\\|")
    lines = ["| " + " | ".join(esc(h) for h in head) + " |",
             "|" + "|".join(" --- " if c.left else " ---: " for c in columns) + "|"]
    return lines + ["| " + " | ".join(esc(x) for x in row) + " |" for row in cells]


def _aligned(columns, head: list[str], cells: list[list[str]]) -> list[str]:
    widths = [max([len(h)] + [len(row[i]) for row in cells]) for i, h in enumerate(head)]

    def line(row: list[str]) -> str:
        parts = [x.ljust(w) if c.left else x.rjust(w) for c, x, w in zip(columns, row, widths)]
        return "  ".join(parts).rstrip()

    return [line(head), "  ".join("-" * w for w in widths)] + [line(row) for row in cells]


def finite_json(value):
    """``value`` with every non-finite float (NaN, inf) replaced by None, at any depth: strict JSON has no NaN or
    Infinity (the reports of ``traces`` and of the main job are written with ``allow_nan=False``)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(item) for item in value]
    return value

"""The benchmarks' tables: markdown through the project's one table formatter (:func:`instrumentation.table.render`).

    print(markdown_table(["rows", "variant", "ms"], [[32, "eager", fmt(1.234, ".3f")], ...]))

Cells are formatted by :func:`fmt` (None -> ``-``, booleans -> yes/no, floats by a format spec); a column whose
every filled cell reads as a number is right-aligned, the others are label columns.
"""

from __future__ import annotations

import re
from typing import Iterable, Optional, Sequence

from instrumentation.table import NULL, Column, render

_NUMBER = re.compile(r"^[-+]?[\d,]*\.?\d+(e[-+]?\d+)?\s*(%|x|ms|s)?$", re.IGNORECASE)


def fmt(value, spec: str = ".3f") -> str:
    """A cell: None -> ``-``, True/False -> yes/no, a float by ``spec`` (NaN: ``-``), anything else ``str``."""
    if value is None:
        return NULL
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return format(value, spec) if value == value else NULL
    return str(value)


def _cell(value) -> Optional[str]:
    if value is None:
        return None
    return (value if isinstance(value, str) else fmt(value)).replace("\n", " ")


def _is_label(column: list) -> bool:
    filled = [text for text in column if text is not None and text != NULL]
    return not filled or not all(_NUMBER.match(text.strip()) for text in filled)


def markdown_table(header: Sequence[str], rows: Iterable[Sequence]) -> str:
    """A markdown table; cells that are not strings pass through :func:`fmt` (floats with 3 decimals)."""
    body = [[_cell(v) for v in row] for row in rows]
    columns = [Column(f"c{i}", title, left=_is_label([row[i] for row in body if i < len(row)]))
               for i, title in enumerate(header)]
    return render(columns, body, "markdown").rstrip("\n")

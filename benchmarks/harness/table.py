"""The one table printer of the benchmarks: markdown, numbers right-aligned, a missing figure as ``-``.

    print(markdown_table(["rows", "variant", "ms"], [[32, "eager", fmt(1.234, ".3f")], ...]))

Cells are formatted by :func:`fmt` (None -> ``-``, booleans -> yes/no, floats by a format spec); a column whose
every filled cell reads as a number is right-aligned.
"""

from __future__ import annotations

import re
from typing import Iterable, Sequence

MISSING = "-"
_NUMBER = re.compile(r"^[-+]?[\d,]*\.?\d+(e[-+]?\d+)?\s*(%|x|ms|s)?$", re.IGNORECASE)


def fmt(value, spec: str = ".3f") -> str:
    """A cell: None -> ``-``, True/False -> yes/no, a float by ``spec``, anything else ``str``."""
    if value is None:
        return MISSING
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return format(value, spec) if value == value else MISSING  # NaN: not measured
    return str(value)


def _cell(value) -> str:
    text = value if isinstance(value, str) else fmt(value)
    return text.replace("|", "/").replace("\n", " ")


def _is_number(text: str) -> bool:
    return bool(_NUMBER.match(text.strip()))


def markdown_table(header: Sequence[str], rows: Iterable[Sequence]) -> str:
    """A markdown table; cells that are not strings pass through :func:`fmt` (floats with 3 decimals)."""
    body = [[_cell(v) for v in row] for row in rows]
    for row in body:
        if len(row) != len(header):
            raise ValueError(f"row has {len(row)} cells, header {len(header)}: {row}")
    numeric = [all(_is_number(r[i]) for r in body if r[i] != MISSING) and any(r[i] != MISSING for r in body)
               for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if n else "---" for n in numeric) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines)

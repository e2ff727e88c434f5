"""Report rows and their details table: the public import path of :mod:`traces.records` and
:func:`traces.format.format_table`.

The rows live in :mod:`traces.records`, which :mod:`traces.format` imports; this module imports
the formats only when ``format_table`` or ``FORMATS`` is asked for (importing the rows stays light,
no numpy), and nothing it imports imports it back.
"""

from __future__ import annotations

from traces.records import (BOUNDS, GpuFigures, KernelRow, SlowestCall, StageRow, Stats,  # noqa: F401
                            StepSpread, percentile)
from traces.saved import row_from_dict  # noqa: F401


def __getattr__(name: str):
    if name in ("format_table", "FORMATS"):  # the formats live in traces.format
        from traces import format as formats

        return getattr(formats, name)
    raise AttributeError(f"module 'traces.rows' has no attribute {name!r}")

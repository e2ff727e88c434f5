"""The project's one table formatter, under its ``traces`` name: it lives in :mod:`instrumentation.table`.

``instrumentation`` never imports ``traces`` (``tests/test_layers.py``), and the live timer table
uses the formatter too, so the formatter sits in ``instrumentation`` and this module re-exports it.
"""

from instrumentation.table import FORMATS, NULL, Column, fixed, percent, render  # noqa: F401

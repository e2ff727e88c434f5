"""Flags of ``opsd-summarize`` that cannot act on this invocation: one warning line each, never ignored silently.

- ``--nvtx-domain`` keeps one NVTX domain of Nsight Systems exports: with no such input (a ``.sqlite`` path, or
  a file with the SQLite header; directories expand to Chrome traces only), among the traces and the ``--diff``
  baseline, it changes nothing.
- ``--diff-wide`` widens the ``--diff`` table: without ``--diff`` there is none.
- ``--kernels N`` adds kernel lists to the table, markdown and JSON outputs; the CSV output has no place for them.
"""

from __future__ import annotations

import os

from traces.nsys import is_sqlite_file


def is_nsys_input(path: str) -> bool:
    """Whether ``path`` is read as an Nsight Systems export (as :func:`traces.load.read_trace` decides)."""
    return path.endswith(".sqlite") or (os.path.isfile(path) and is_sqlite_file(path))


def flag_warnings(args) -> list[str]:
    """The warnings about flags of ``args`` (parsed by :func:`traces.cli.parse_args`) that have no effect."""
    out = []
    inputs = list(args.paths) + ([args.diff] if args.diff else [])
    if args.nvtx_domain is not None and not any(is_nsys_input(p) for p in inputs):
        out.append(f"--nvtx-domain {args.nvtx_domain!r} applies to Nsight Systems exports (.sqlite) only, and no input "
                   "is one (Chrome / TensorBoard traces): ignored")
    if getattr(args, "diff_wide", False) and not args.diff:
        out.append("--diff-wide applies with --diff only: ignored")
    if args.kernels and args.format == "csv":
        out.append(f"--kernels {args.kernels}: the CSV output has no kernel lists (use --format table, markdown or "
                   "json): ignored")
    return out

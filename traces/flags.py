"""Flags of ``opsd-summarize`` that cannot act on this invocation: one warning line each, never ignored silently.

- ``--nvtx-domain`` keeps one NVTX domain of Nsight Systems exports: with no such input (a ``.sqlite`` path, or
  a file with the SQLite header; directories expand to Chrome traces only), among the traces and the ``--diff``
  baseline, it changes nothing.
- ``--diff-wide`` widens the ``--diff`` table: without ``--diff`` there is none.
- ``--kernels N`` adds kernel lists to the table, markdown and JSON outputs; the CSV output has no place for them.
- A flag of one value given twice (``--format json --format csv``): the last one is used.
- A trace path given twice (also through another spelling of it): it is read once.
"""

from __future__ import annotations

import os

from traces.nsys import is_sqlite_file


def is_nsys_input(path: str) -> bool:
    """Whether ``path`` is read as an Nsight Systems export (as :func:`traces.load.read_trace` decides)."""
    return path.endswith(".sqlite") or (os.path.isfile(path) and is_sqlite_file(path))


#: The flags of ``opsd-summarize`` that take one value.
ONE_VALUE = ("--format", "--prefix", "--diff", "--plot", "--tensorboard", "--kernels", "--nvtx-domain")


def repeated_flags(argv: list[str]) -> list[str]:
    """Warnings for the flags of :data:`ONE_VALUE` given more than once in ``argv`` (argparse keeps the last)."""
    counts: dict[str, int] = {}
    for token in argv:
        if token == "--":
            break
        name = token.partition("=")[0]
        if name in ONE_VALUE:
            counts[name] = counts.get(name, 0) + 1
    return [f"{name} given {count} times: only the last one is used" for name, count in counts.items() if count > 1]


def flag_warnings(args) -> list[str]:
    """The warnings about flags of ``args`` (parsed by :func:`traces.cli.parse_args`) that have no effect."""
    out = list(getattr(args, "repeated", []))
    seen: set = set()
    for path in args.paths:
        key = os.path.realpath(path)
        if key in seen:
            out.append(f"{path}: given twice; read once")
        seen.add(key)
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

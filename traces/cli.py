"""``opsd-summarize`` / ``scripts/summarize_trace.py``: per-stage report of profiler traces.

Exit status: 0 on success; 2 when any input is bad (one stderr line per problem, naming the file;
the report of the good files is still printed) or an optional output cannot be produced.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

from instrumentation import stages as S
from traces.diff import diff_rows, format_diff, row_from_dict
from traces.load import load, read_trace
from traces.report import Report, build_report
from traces.rows import format_table

FORMATS = ("table", "markdown", "json", "csv")
#: A --diff baseline smaller than this is first tried as a saved JSON report.
MAX_REPORT_BYTES = 64 << 20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="opsd-summarize", description=(
        "Per-stage CPU/GPU time and peak memory from torch.profiler Chrome traces or Nsight "
        "Systems SQLite exports."))
    p.add_argument("paths", nargs="+", metavar="PATH",
                   help="trace files (.json / .json.gz), directories of *.pt.trace.json[.gz], or "
                        "Nsight Systems exports (nsys export --type sqlite: .sqlite)")
    p.add_argument("--format", choices=FORMATS, default="table")
    p.add_argument("--prefix", default=S.PREFIX,
                   help=f"stage range name prefix (default {S.PREFIX!r}; '' takes every range)")
    p.add_argument("--by-rank", action="store_true", help="also report per rank and stragglers")
    p.add_argument("--by-step", action="store_true", help="also report per step range")
    p.add_argument("--diff", metavar="BASELINE",
                   help="compare with a baseline: a saved --format json report, or trace path(s)")
    p.add_argument("--plot", metavar="PNG", help="write stacked per-stage bars (needs matplotlib)")
    p.add_argument("--tensorboard", metavar="DIR", help="write per-stage TensorBoard scalars")
    p.add_argument("--nvtx-domain", metavar="D", default=None,
                   help=f"Nsight Systems inputs: keep the NVTX ranges of domain D only (ours: "
                        f"{S.NVTX_DOMAIN!r}; default: every domain)")
    return p.parse_args(argv)


def _source(args):
    """The event source for this invocation (the NVTX domain filter of SQLite inputs)."""
    return functools.partial(read_trace, nvtx_domain=args.nvtx_domain)


def _baseline_rows(path: str, prefix: str, errors: list[str], args):
    """Rows of the --diff baseline, or None (with the problem appended to ``errors``)."""
    if os.path.isfile(path) and os.path.getsize(path) < MAX_REPORT_BYTES:
        with open(path, "rb") as f:
            head = f.read(4096)
        if b'"schema_version"' in head:
            try:
                with open(path, encoding="utf-8") as f:
                    doc = json.load(f)
                return [row_from_dict(d) for d in doc["stages"]]
            except (ValueError, KeyError, TypeError) as exc:
                errors.append(f"{path}: not a valid report ({exc})")
                return None
    loaded = load([path], _source(args))
    errors.extend(str(e) for e in loaded.errors)
    rows = build_report(loaded, prefix).stages if loaded.files else []
    if loaded.files and not rows:
        errors.append(f"{path}: no ranges matching prefix {prefix!r} in the baseline")
    return rows or None


def _render(report: Report, args) -> str:
    if args.format == "json":
        return json.dumps(report.to_dict(args.by_rank, args.by_step), indent=2) + "\n"
    if args.format == "csv":
        rows = list(report.stages)
        if args.by_rank:
            rows = [r for k in sorted(report.per_rank) for r in report.per_rank[k]]
        if args.by_step:
            rows += [r for k in sorted(report.per_step) for r in report.per_step[k]]
        return format_table(rows, "csv")
    parts = [f"ranks: {report.ranks}  files: {len(report.sources)}\n", format_table(report.stages, args.format)]
    if args.by_rank:
        for k in sorted(report.per_rank):
            parts += [f"\nrank {k}\n", format_table(report.per_rank[k], args.format)]
        parts.append("\nstraggler (slowest rank by CPU total) and CPU total over ranks (ms):\n")
        for name, rank in report.straggler.items():
            s = report.rank_spread[name]["cpu_total_ms"]
            parts.append(f"  {name}: rank {rank}  min {s['min']:.3f}  median {s['median']:.3f}  "
                         f"max {s['max']:.3f}\n")
    if args.by_step:
        for k in sorted(report.per_step):
            parts += [f"\nstep {k}\n", format_table(report.per_step[k], args.format)]
    if report.diff is not None:
        parts += ["\ndiff (after - before, totals in ms)\n", format_diff(report.diff)]
    return "".join(parts)


def run(args) -> int:
    from traces.plot import OutputError, plot_breakdown, write_tensorboard

    loaded = load(args.paths, _source(args))
    errors = [str(e) for e in loaded.errors]
    report = build_report(loaded, args.prefix) if loaded.files else None
    if report is not None and not report.stages:
        names = ", ".join(d.path for d in loaded.files)
        errors.append(f"{names}: no user_annotation ranges matching prefix {args.prefix!r}")
        report = None
    if report is not None and args.diff:
        before = _baseline_rows(args.diff, args.prefix, errors, args)
        if before is not None:
            report.diff = diff_rows(before, report.stages)
    for w in (report.warnings if report else loaded.warnings):
        print(f"warning: {w}", file=sys.stderr)
    if report is not None:
        sys.stdout.write(_render(report, args))
        try:
            if args.plot:
                plot_breakdown(report, args.plot, by_step=args.by_step)
            if args.tensorboard:
                write_tensorboard(report, args.tensorboard)
        except OutputError as exc:
            errors.append(str(exc))
    for e in errors:
        print(f"error: {e}", file=sys.stderr)
    return 2 if errors or report is None else 0


def main(argv=None) -> int:
    """Console entry point; returns (and, as a script, exits with) the status."""
    args = parse_args(argv)
    try:
        return run(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a bug must still not print a traceback at users: one line, exit 2
        print(f"error: {', '.join(args.paths)}: internal error {type(exc).__name__}: {exc} "
              f"(set OPSD_TRACEBACK=1 for details)", file=sys.stderr)
        if os.environ.get("OPSD_TRACEBACK"):
            raise
        return 2


if __name__ == "__main__":
    sys.exit(main())

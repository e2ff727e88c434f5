"""``opsd-summarize`` / ``scripts/summarize_trace.py``: per-stage report of profiler traces.

Exit status: 0 on success; 2 when any input is bad (one stderr line per problem, naming the file;
the report of the good files is still printed) or an optional output cannot be produced. Bad
events inside a readable file, ``*.partial`` exports and non-regular files are warnings (one line
per file), not errors. A file whose data breaks the report is named and left out of it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys

from instrumentation import stages as S
from instrumentation.cli_values import parse_int_text
from instrumentation.config import parse_bool
from traces.runs import csv_cell, group_by_run
from traces import kernel_diff
from traces.diff import baseline_problem, diff_columns, diff_headline, diff_rows, diff_values, format_diff, noise_note
from traces.findings import format_findings, report_findings
from traces.flags import flag_warnings, repeated_flags
from traces.format import csv_rows, format_headline, format_kernels, format_overview, format_table
from traces.load import LoadedSet, load, read_trace
from traces.names import shown
from traces.console import out as _out, say as _say
from traces.report import SCHEMA_VERSION, Report, build_report
from traces.saved import row_from_dict
from instrumentation.table import Column, finite_json, render

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
    p.add_argument("--diff-wide", action="store_true",
                   help="with --diff: every figure (both clocks, noise, per-call means, counts), not the compact table")
    p.add_argument("--plot", metavar="PNG", help="write stacked per-stage bars (matplotlib: .png, .svg, .pdf, ...)")
    p.add_argument("--tensorboard", metavar="DIR", help="write per-stage TensorBoard scalars")
    p.add_argument("--kernels", metavar="N", type=_kernels_arg, default=0,
                   help="list the top N kernels (and copies) of each stage by GPU time and the start of its "
                        "slowest call; with --diff (traces), also the N whose GPU time changed most")
    p.add_argument("--nvtx-domain", metavar="D", default=None,
                   help=f"Nsight Systems inputs: keep the NVTX ranges of domain D only (ours: "
                        f"{S.NVTX_DOMAIN!r}; default: every domain; a warning for other inputs)")
    args = p.parse_args(argv)
    args.repeated = repeated_flags(list(sys.argv[1:] if argv is None else argv))
    return args


def _kernels_arg(text: str) -> int:
    value = parse_int_text(text)
    if value is None or value < 0:
        raise argparse.ArgumentTypeError(f"--kernels must be an integer >= 0; got {text!r}")
    return value


def _source(args):
    """The event source for this invocation (the NVTX domain filter of SQLite inputs)."""
    return functools.partial(read_trace, nvtx_domain=args.nvtx_domain)


def _reject_constant(name: str):
    raise ValueError(f"non-standard JSON constant {name}")


def _baseline_rows(path: str, prefix: str, problems: tuple[list, list], args):
    """Rows of the --diff baseline (None on a problem) and, from traces, every kernel of each stage (with
    ``--kernels``; else None); its problems go to ``problems`` (errors, warnings), each naming the baseline's file."""
    errors, warnings = problems
    if os.path.isfile(path) and os.path.getsize(path) < MAX_REPORT_BYTES:
        with open(path, "rb") as f:
            head = f.read(4096)
        if b'"schema_version"' in head:
            try:
                with open(path, encoding="utf-8") as f:
                    doc = json.load(f, parse_constant=_reject_constant)
                problem = baseline_problem(doc)
                if problem is not None:
                    errors.append(f"{path}: --diff baseline {problem}")
                    return None, None
                return [row_from_dict(d) for d in doc["stages"]], None
            except Exception as exc:  # noqa: BLE001 - any flaw of the saved report (RecursionError too)
                errors.append(f"{path}: --diff baseline is not a valid report ({type(exc).__name__}: {exc})")
                return None, None
    loaded = load([path], _source(args))
    errors.extend(f"{e} (--diff baseline)" for e in loaded.errors)
    warnings.extend(loaded.warnings)
    report = _isolated_report(loaded, dict(prefix=prefix, kernels=args.kernels, steps=False), errors)
    rows = report.stages if report is not None else []
    if loaded.files and not rows:
        errors.append(f"{path}: no ranges matching prefix {prefix!r} in the --diff baseline")
    return rows or None, report.stage_kernels if rows and args.kernels else None


def _isolated_report(loaded, options: dict, errors: list[str]):
    """``build_report`` over the files of ``loaded``; a file whose data breaks it is named in
    ``errors`` and left out (the others are still reported). None without any file."""
    if not loaded.files:
        return None
    try:
        return build_report(loaded, **options)
    except Exception:  # noqa: BLE001 - find the file(s) responsible, report the others
        pass
    good = []
    for data in loaded.files:
        try:
            build_report(LoadedSet(files=[data]), **options)
            good.append(data)
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{data.path}: cannot be summarised ({type(exc).__name__}: {exc})")
    if not good:
        return None
    return build_report(dataclasses.replace(loaded, files=good), **options)


def _csv(report: Report, args) -> str:
    rows = list(report.stages)
    if args.by_rank:
        rows = [r for k in sorted(report.per_rank) for r in report.per_rank[k]]
    if args.by_step:
        rows += [r for k in sorted(report.per_step) for r in report.per_step[k]]
    columns, values = csv_rows(rows)
    if report.diff is not None:  # the diff's columns on the merged rows; before-only stages added
        extra = diff_columns()[1:]
        by_name = {d["name"]: diff_values(d)[1:] for d in report.diff}
        merged = lambda r: r.rank is None and r.step is None
        values = [v + (by_name.pop(r.name, [None] * len(extra)) if merged(r) else [None] * len(extra))
                  for r, v in zip(rows, values)]
        values += [[name if c.key == "name" else None for c in columns] + rest
                   for name, rest in by_name.items()]
        columns = columns + [Column("diff_" + c.key, c.title) for c in extra]
    return render(columns, values, "csv")


def _render(report: Report, args) -> str:
    if args.format == "json":
        doc = {**report.to_dict(args.by_rank, args.by_step), "findings": [f.to_dict() for f in report_findings(report)]}
        return json.dumps(finite_json(doc), indent=2, allow_nan=False) + "\n"
    if args.format == "csv":
        return _csv(report, args)
    fmt = args.format
    parts = [f"ranks: {report.ranks}  files: {len(report.sources)}\n", format_headline(report.headline),
             format_findings(report_findings(report)), "\n", format_overview(report.stages, fmt)]
    if args.kernels:
        parts += ["\ntop kernels per stage (inclusive of nested stages)\n", format_kernels(report.stages, fmt)]
    parts += ["\ndetails (ms)\n", format_table(report.stages, fmt)]
    if args.by_rank:
        for k in sorted(report.per_rank):
            parts += [f"\nrank {k}: ", format_headline(report.rank_headline.get(k)),
                      format_overview(report.per_rank[k], fmt)]
        parts.append("\nstraggler (slowest rank by CPU total) and CPU total over ranks (ms):\n")
        for name, rank in report.straggler.items():
            s = report.rank_spread[name]["cpu_total_ms"]
            parts.append(f"  {shown(name)}: rank {rank}  min {s['min']:.3f}  median {s['median']:.3f}  "
                         f"max {s['max']:.3f}\n")
    if args.by_step:
        for k in sorted(report.per_step):
            parts += [f"\nstep {k}\n", format_overview(report.per_step[k], fmt)]
    if report.diff is not None:
        head = diff_headline(report.diff)
        if head:  # the headline first: the line a PR quotes
            parts.insert(0, f"diff: {head}\n")
        parts += [f"\ndiff ({noise_note(report.diff)})\n",
                  format_diff(report.diff, fmt, wide=getattr(args, "diff_wide", False))]
        changes = kernel_diff.format_kernel_changes(report.diff, fmt)
        parts += ["\nkernels that changed most per stage (GPU ms over each side's traces)\n", changes] if changes else []
    return "".join(parts)


def run(args) -> int:
    from traces.plot import OutputError, path_flag_problem, plot_problem, plot_report
    from traces.tensorboard import write_tensorboard

    problem = path_flag_problem(args) or (plot_problem(args.plot) if args.plot else None)
    if problem:  # before any trace is read: not after the whole report has printed
        _say("error", problem)
        return 2
    for w in flag_warnings(args):  # once, before the inputs' own warnings
        _say("warning", w)
    loaded = load(args.paths, _source(args))
    runs = group_by_run(loaded)
    if len(runs) > 1:
        return _run_each(args, loaded, runs)
    errors = [str(e) for e in loaded.errors]
    steps = args.by_step or bool(args.tensorboard)
    options = dict(prefix=args.prefix, kernels=args.kernels, steps=steps)
    report = _isolated_report(loaded, options, errors)
    if report is None and not loaded.errors and not errors:
        errors.append(f"{', '.join(args.paths)}: no trace to report (every input was skipped)")
    if report is not None and not report.stages:
        names = ", ".join(d.path for d in loaded.files)
        errors.append(f"{names}: no user_annotation ranges matching prefix {args.prefix!r}")
        report = None
    before, warnings = None, list(report.warnings if report else loaded.warnings)
    if report is not None and args.diff:
        before, kernels = _baseline_rows(args.diff, args.prefix, (errors, warnings), args)
        if before is not None:
            report.diff = diff_rows(before, report.stages)
            if args.kernels and kernels is not None:
                kernel_diff.attach(report.diff, kernels, report.stage_kernels, args.kernels)
            elif args.kernels:
                warnings.append(f"{args.diff}: a saved report keeps no kernel lists; --kernels compares traces only")
    for w in warnings:
        _say("warning", w)
    if report is not None:
        _out(_render(report, args))
        try:
            if args.plot:
                plot_report(report, args.plot, by_step=args.by_step, before=before)
            if args.tensorboard:
                write_tensorboard(report, args.tensorboard)
        except OutputError as exc:
            errors.append(str(exc))
    for e in errors:
        _say("error", e)
    return 2 if errors or report is None else 0


def _run_each(args, loaded, runs) -> int:
    """Inputs of several runs: each run's report under its name, its steps numbered on their own."""
    errors = [str(e) for e in loaded.errors]
    for w in loaded.warnings:
        _say("warning", w)
    names = ", ".join(r.name or "(no run)" for r in runs)
    single = [flag for flag, value in (("--diff", args.diff), ("--plot", args.plot),
                                       ("--tensorboard", args.tensorboard)) if value]
    if single:
        _say("error", f"{', '.join(args.paths)}: the inputs hold {len(runs)} runs ({names}); {', '.join(single)} "
                      "takes one run: pass its run directory")
        return 2
    options = dict(prefix=args.prefix, kernels=args.kernels, steps=args.by_step)
    docs, texts, ok = [], [], 0
    for run in runs:
        report = _isolated_report(run.files, options, errors)
        if report is None or not report.stages:
            errors.append(f"{run.label}: no user_annotation ranges matching prefix {args.prefix!r}")
            continue
        ok += 1
        for w in report.warnings:
            _say("warning", f"{run.label}: {w}")
        if args.format == "json":
            docs.append({"run": run.name, "run_id": run.run_id, **report.to_dict(args.by_rank, args.by_step)})
        elif args.format == "csv":  # one table: a leading run column
            lines = _csv(report, args).splitlines()
            texts.append(([] if texts else ["run," + lines[0]]) + [csv_cell(run.name) + "," + x for x in lines[1:]])
        else:
            heading = f"## {run.label}" if args.format == "markdown" else f"=== {run.label} ==="
            texts.append([heading, "", _render(report, args)])
    if args.format == "json":
        _out(json.dumps(finite_json({"schema_version": SCHEMA_VERSION, "runs": docs}), indent=2,
                                    allow_nan=False) + "\n")
    else:
        _out("\n".join(line for part in texts for line in part) + ("\n" if texts else ""))
    for e in errors:
        _say("error", e)
    return 2 if errors or not ok else 0


def main(argv=None) -> int:
    """Console entry point; returns (and, as a script, exits with) the status."""
    args = parse_args(argv)
    try:
        show_traceback = parse_bool(os.environ.get("OPSD_TRACEBACK", "") or "0", "OPSD_TRACEBACK")
    except ValueError as exc:
        _say("error", exc)
        return 2
    try:
        return run(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a bug must still not print a traceback at users: one line, exit 2
        inputs = ", ".join(args.paths) + (f" (--diff {args.diff})" if args.diff else "")
        _say("error", f"{inputs}: internal error {type(exc).__name__}: {exc} (set OPSD_TRACEBACK=1 for details)")
        if show_traceback:
            raise
        return 2


if __name__ == "__main__":
    sys.exit(main())

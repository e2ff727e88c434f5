#!/usr/bin/env python
"""Keep one step of a torch.profiler Chrome trace and write it gzip-compressed (test data, bug reports).

    python scripts/trim_trace.py IN.pt.trace.json[.gz] OUT.pt.trace.json.gz [--step N] [--max-mb 5]

``--step N`` picks the ``opsd/step`` range of training step N (the N of torch.profiler's
``ProfilerStep#N``; without those marks, the N-th step range); the default is the last one. What is
kept is listed in ``traces/trim.py``. While the output is larger than ``--max-mb``, whole categories
are dropped in the order ``python_function``, ``cpu_op``, other instant events, flow arrows; the
script says which, and exits 2 when even that is not enough. Prints the kept step and the sizes.

Bad input is one ``error:`` line naming the flag or the file, exit status 2: a missing, empty or truncated
source, an output that is the source itself (it was overwritten), a directory or in a missing folder, a
``--max-mb`` that is not a finite number > 0; an output not named ``.gz`` is warned.
The output is written to ``OUT.tmpPID`` and renamed only when it is complete and small enough: a failure
leaves no file behind (an existing OUT is kept as it was).
"""

import argparse
import gzip
import json
import math
import sys
import zlib

from instrumentation.cli_values import output_problem, parse_int_text
from instrumentation.export import write_atomic
from traces.trim import DROP_ORDER, drop_categories, step_index, step_ranges, trim_events


def _step_arg(text: str) -> int:
    """A step index in ASCII digits (``int()`` also reads '٣' as 3)."""
    value = parse_int_text(text)
    if value is None:
        raise argparse.ArgumentTypeError(f"--step must be an integer; got {text!r}")
    return value


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("source", help="a Chrome trace (.json or .json.gz)")
    p.add_argument("output", help="where to write the trimmed trace (gzip)")
    p.add_argument("--step", type=_step_arg, default=None, help="training step to keep (default: the last)")
    p.add_argument("--stage", default="opsd/step", help="range name of a step (default opsd/step)")
    p.add_argument("--max-mb", type=_max_mb_arg, default=5.0, help="largest output, MB of gzip (default 5)")
    return p.parse_args(argv)


def _max_mb_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"--max-mb must be a finite number > 0; got {text!r}")
    return value


class InputError(Exception):
    """A source or output path that cannot be used; ``str()`` is one line naming it."""


class StepError(InputError):
    """No step range to keep (``--stage`` / ``--step``); ``str()`` does not name the file."""


def check_output(path: str, source: str = "") -> None:
    """:class:`InputError` when ``path`` cannot be the output (checked before the source is read;
    :func:`instrumentation.cli_values.output_problem`): among others, the source itself (it was overwritten by its own
    trimmed copy)."""
    why = output_problem(path, source=source or None)
    if why:
        raise InputError(f"{path}: output {why}; give another path")


def load(path: str) -> dict:
    """The trace document of ``path``; :class:`InputError` naming the file when it cannot be read."""
    try:
        with open(path, "rb") as f:
            gz = f.read(2) == b"\x1f\x8b"
        with (gzip.open if gz else open)(path, "rt", encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise InputError(f"{path}: is a directory (give a trace file)") from None
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise InputError(f"{path}: truncated or corrupt gzip ({exc})") from None
    except UnicodeDecodeError:
        raise InputError(f"{path}: not UTF-8 text") from None
    except (ValueError, RecursionError) as exc:
        what = "empty file" if isinstance(exc, json.JSONDecodeError) and exc.doc.strip() == "" else \
            f"not valid JSON or truncated ({type(exc).__name__}: {str(exc)[:80]})"
        raise InputError(f"{path}: {what}") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if isinstance(doc, list):
        return {"traceEvents": doc}
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents", []), list):
        raise InputError(f"{path}: not a Chrome trace (no traceEvents array)")
    return doc


def pick(events: list, stage: str, step) -> dict:
    ranges = step_ranges(events, stage)
    if not ranges:
        raise StepError(f"no {stage!r} range in the trace (--stage)")
    if step is None:
        return ranges[-1]
    for k, r in enumerate(ranges):
        index = step_index(events, r)
        if (k if index is None else index) == step:
            return r
    raise StepError(f"no {stage!r} range of step {step} in the trace (--step)")


def compressed(doc: dict) -> bytes:
    """``doc`` as gzip-compressed JSON."""
    return gzip.compress(json.dumps(doc, allow_nan=False).encode("utf-8"), compresslevel=9)


def write_output(path: str, data: bytes) -> None:
    """``instrumentation.export.write_atomic`` (a failed write leaves no file); :class:`InputError` naming the path
    when it cannot be written."""
    try:
        write_atomic(path, data)
    except OSError as exc:
        raise InputError(f"{path}: cannot write ({exc.strerror or exc})") from None


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        check_output(args.output, args.source)
        if not args.output.endswith(".gz"):
            print(f"warning: {args.output}: the output is gzip-compressed; name it .json.gz so that readers "
                  "expect it", file=sys.stderr)
        doc = load(args.source)
        return _trim(doc, args)
    except StepError as exc:
        print(f"error: {args.source}: {exc}", file=sys.stderr)
        return 2
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (ValueError, TypeError, KeyError) as exc:  # events whose fields cannot be used
        print(f"error: {args.source}: cannot be trimmed ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 2


def _trim(doc: dict, args) -> int:
    events = doc.get("traceEvents") or []
    step = pick(events, args.stage, args.step)
    kept = trim_events(events, step)
    index = step_index(events, step)
    print(f"step {'(no ProfilerStep mark)' if index is None else index} ({args.stage} at ts {step['ts']}, "
          f"{float(step['dur']) / 1e3:.1f} ms): {len(kept)} of {len(events)} events")
    dropped = []
    for category in (None,) + DROP_ORDER:
        if category is not None:
            kept = drop_categories(kept, [category])
            dropped.append(category)
        data = compressed(dict(doc, traceEvents=kept))
        if len(data) <= args.max_mb * 1e6:
            break
    dropped_text = f"; dropped categories {', '.join(dropped)}" if dropped else ""
    if len(data) > args.max_mb * 1e6:
        print(f"error: {args.output}: not written: still larger than --max-mb {args.max_mb} MB "
              f"({len(data) / 1e6:.4f} MB gzip{dropped_text})", file=sys.stderr)
        return 2
    write_output(args.output, data)
    print(f"wrote {args.output}: {len(data) / 1e6:.2f} MB gzip, {len(kept)} events{dropped_text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

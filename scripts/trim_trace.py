#!/usr/bin/env python
"""Keep one step of a torch.profiler Chrome trace and write it gzip-compressed (test data, bug reports).

    python scripts/trim_trace.py IN.pt.trace.json[.gz] OUT.pt.trace.json.gz [--step N] [--max-mb 5]

``--step N`` picks the ``opsd/step`` range of training step N (the N of torch.profiler's
``ProfilerStep#N``; without those marks, the N-th step range); the default is the last one. What is
kept is listed in ``traces/trim.py``. While the output is larger than ``--max-mb``, whole categories
are dropped in the order ``python_function``, ``cpu_op``, other instant events, flow arrows; the
script says which, and exits 2 when even that is not enough. Prints the kept step and the sizes.
"""

import argparse
import gzip
import json
import sys

from traces.trim import DROP_ORDER, drop_categories, step_index, step_ranges, trim_events


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("source", help="a Chrome trace (.json or .json.gz)")
    p.add_argument("output", help="where to write the trimmed trace (gzip)")
    p.add_argument("--step", type=int, default=None, help="training step to keep (default: the last)")
    p.add_argument("--stage", default="opsd/step", help="range name of a step (default opsd/step)")
    p.add_argument("--max-mb", type=float, default=5.0, help="largest output, MB of gzip (default 5)")
    return p.parse_args(argv)


def load(path: str) -> dict:
    with open(path, "rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
    with (gzip.open if gz else open)(path, "rt", encoding="utf-8") as f:
        doc = json.load(f)
    return doc if isinstance(doc, dict) else {"traceEvents": doc}


def pick(events: list, stage: str, step) -> dict:
    ranges = step_ranges(events, stage)
    if not ranges:
        sys.exit(f"error: no {stage!r} range in the trace")
    if step is None:
        return ranges[-1]
    for k, r in enumerate(ranges):
        index = step_index(events, r)
        if (k if index is None else index) == step:
            return r
    sys.exit(f"error: no {stage!r} range of step {step}")


def write(doc: dict, path: str) -> int:
    data = gzip.compress(json.dumps(doc, allow_nan=False).encode("utf-8"), compresslevel=9)
    with open(path, "wb") as f:
        f.write(data)
    return len(data)


def main(argv=None) -> int:
    args = parse_args(argv)
    doc = load(args.source)
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
        size = write(dict(doc, traceEvents=kept), args.output)
        if size <= args.max_mb * 1e6:
            break
    print(f"wrote {args.output}: {size / 1e6:.2f} MB gzip, {len(kept)} events"
          + (f"; dropped categories {', '.join(dropped)}" if dropped else ""))
    if size > args.max_mb * 1e6:
        print(f"error: still larger than {args.max_mb} MB", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

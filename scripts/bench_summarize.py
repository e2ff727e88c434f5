#!/usr/bin/env python
"""Benchmark of the trace summary against a plain ``json.load`` (not a test).

Generates a synthetic multi-rank trace set with a realistic event mix (traces/synth.py), then
runs each contender in its own child process and reports wall time and peak RSS (``wait4``):

- ``gzip only``: decompressing every file (a floor);
- ``json.load``: loading every file whole with the standard library, one process per file;
- ``summary``: ``opsd-summarize --format json`` over the whole set, one process;
- ``HTA``: Holistic Trace Analysis' ``get_gpu_user_annotation_breakdown`` when it imports.

Example: ``python scripts/bench_summarize.py --size-mb 1024 --num-ranks 2 --repeats 1``
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from traces.synth import SynthConfig, write_synthetic_trace  # noqa: E402

_GZIP = "import gzip,sys\nfor p in sys.argv[1:]:\n  f=gzip.open(p,'rb')\n  while f.read(1<<24): pass"
_JSON = "import gzip,json,sys\njson.load(gzip.open(sys.argv[1],'rt'))"
_HTA = ("import sys,hta.trace_analysis as t\n"
        "a=t.TraceAnalysis(trace_dir=sys.argv[1])\na.get_gpu_user_annotation_breakdown()")


def measure(argv: list[str]) -> tuple[float, float, int]:
    """(seconds, peak RSS MiB, exit status) of one child process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=dict(os.environ, PYTHONPATH=ROOT))
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    return seconds, usage.ru_maxrss / 1024.0, proc.returncode


def run_case(argvs: list[list[str]], repeats: int) -> tuple[float, float, int]:
    """Median over repeats of (summed time, max RSS) of running ``argvs`` one after another."""
    times, rss, status = [], [], 0
    for _ in range(repeats):
        results = [measure(a) for a in argvs]
        times.append(sum(r[0] for r in results))
        rss.append(max(r[1] for r in results))
        status = max(status, *(r[2] for r in results))
    return statistics.median(times), statistics.median(rss), status


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=float, default=1024, help="uncompressed size of the whole set")
    p.add_argument("--num-ranks", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--workdir", default=None, help="where the traces go (default: a temp dir)")
    p.add_argument("--skip-json-load", action="store_true")
    args = p.parse_args(argv)
    if args.size_mb <= 0 or args.num_ranks < 1 or args.repeats < 1:
        p.error("--size-mb must be > 0, --num-ranks and --repeats >= 1")
    workdir = args.workdir or tempfile.mkdtemp(prefix="opsd_bench_")
    os.makedirs(workdir, exist_ok=True)
    paths = []
    t0 = time.perf_counter()
    for rank in range(args.num_ranks):
        path = os.path.join(workdir, f"rank{rank}.pt.trace.json.gz")
        cfg = SynthConfig(target_bytes=int(args.size_mb * (1 << 20) / args.num_ranks), rank=rank,
                          world_size=args.num_ranks)
        write_synthetic_trace(path, cfg)
        paths.append(path)
    gz_mb = sum(os.path.getsize(x) for x in paths) / (1 << 20)
    print(f"generated {args.num_ranks} files, {args.size_mb:.0f} MB uncompressed, {gz_mb:.0f} MB gzip, "
          f"in {time.perf_counter() - t0:.0f} s ({workdir})")
    py = sys.executable
    cases = [("gzip only", [[py, "-c", _GZIP, *paths]])]
    if not args.skip_json_load:
        cases.append(("json.load", [[py, "-c", _JSON, x] for x in paths]))
    cases.append(("summary", [[py, "-m", "traces.cli", *paths, "--format", "json", "--by-rank"]]))
    try:
        import hta  # noqa: F401
        cases.append(("HTA user-annotation breakdown", [[py, "-c", _HTA, workdir]]))
    except ImportError:
        print("HTA: not importable here, skipped")
    results = {name: run_case(argvs, args.repeats) for name, argvs in cases}
    print(f"\npython {platform.python_version()}, {os.cpu_count()} cores, medians of "
          f"{args.repeats}\n")
    ref = results.get("json.load")
    print("| case | time s | peak RSS MiB | time / json.load | RSS / json.load | exit |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, (sec, rss, status) in results.items():
        rel = (f"{sec / ref[0]:.2f}", f"{rss / ref[1]:.3f}") if ref else ("-", "-")
        print(f"| {name} | {sec:.1f} | {rss:.0f} | {rel[0]} | {rel[1]} | {status} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

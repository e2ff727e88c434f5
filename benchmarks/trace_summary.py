"""Benchmark of the trace summary against a plain ``json.load`` (not a test).

Generates a synthetic multi-rank trace set with a realistic event mix (traces/synth.py), then
runs each contender in its own child process, in the harness's rounds (no warm-up: each child starts cold, as a
user's does), and reports the median wall time and peak RSS (``wait4``):

- ``gzip only``: decompressing every file (a floor);
- ``json.load``: loading every file whole with the standard library, one process per file;
- ``summary``: ``opsd-summarize --format json`` over the whole set, one process;
- ``HTA``: Holistic Trace Analysis' ``get_gpu_user_annotation_breakdown`` when it imports.

Example: ``python -m benchmarks.trace_summary --size-mb 1024 --num-ranks 2 --repeats 1``
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from benchmarks.harness import results
from benchmarks.harness.cli import finite_number, int_at_least, out_path
from benchmarks.harness.meta import header, run_meta
from benchmarks.harness.rounds import Rounds, run_rounds
from benchmarks.harness.table import markdown_table
from traces.synth import SynthConfig, write_synthetic_trace

_GZIP = "import gzip,sys\nfor p in sys.argv[1:]:\n  f=gzip.open(p,'rb')\n  while f.read(1<<24): pass"
_JSON = "import gzip,json,sys\njson.load(gzip.open(sys.argv[1],'rt'))"
_HTA = ("import sys,hta.trace_analysis as t\n"
        "a=t.TraceAnalysis(trace_dir=sys.argv[1])\na.get_gpu_user_annotation_breakdown()")


def measure(argv: list[str]) -> tuple[float, float, int]:
    """(seconds, peak RSS MiB, exit status) of one child process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    return seconds, usage.ru_maxrss / 1024.0, proc.returncode


@dataclass
class SummaryRow:
    case: str
    seconds: float
    """Median over the rounds of the case's summed wall time (its processes one after another)."""
    peak_rss_mib: float
    """Median over the rounds of the largest peak RSS of its processes."""
    exit_status: int
    """The worst exit status seen."""


def run_cases(cases: dict[str, list[list[str]]], repeats: int) -> list[SummaryRow]:
    """Each case's processes, the cases in the harness's rounds (alternating order, no warm-up)."""
    seen: dict[str, list[tuple[float, float, int]]] = {name: [] for name in cases}

    def call(name, seed, timed):
        done = [measure(a) for a in cases[name]]
        seen[name].append((sum(r[0] for r in done), max(r[1] for r in done), max(r[2] for r in done)))

    run_rounds(list(cases), Rounds(repeats, warmup=0), call)
    return [SummaryRow(name, statistics.median(r[0] for r in v), statistics.median(r[1] for r in v),
                       max(r[2] for r in v)) for name, v in seen.items()]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m benchmarks.trace_summary", description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=finite_number(0.0, above=True), default=1024,
                   help="uncompressed size of the whole set")
    p.add_argument("--num-ranks", type=int_at_least(1), default=2)
    p.add_argument("--repeats", type=int_at_least(1), default=1)
    p.add_argument("--workdir", default=None, help="where the traces go (default: a temp dir)")
    p.add_argument("--skip-json-load", action="store_true")
    p.add_argument("--json", type=out_path, help="write the result file here")
    args = p.parse_args(argv)
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
    cases = {"gzip only": [[py, "-c", _GZIP, *paths]]}
    if not args.skip_json_load:
        cases["json.load"] = [[py, "-c", _JSON, x] for x in paths]
    cases["summary"] = [[py, "-m", "traces.cli", *paths, "--format", "json", "--by-rank"]]
    try:
        import hta  # noqa: F401
        cases["HTA user-annotation breakdown"] = [[py, "-c", _HTA, workdir]]
    except ImportError:
        print("HTA: not importable here, skipped")
    rows = run_cases(cases, args.repeats)
    meta = run_meta("trace_summary", argv, cores=os.cpu_count(), size_mb=args.size_mb, num_ranks=args.num_ranks)
    print(f"\n{header(meta)}; {os.cpu_count()} cores, medians of {args.repeats}\n")
    ref = next((r for r in rows if r.case == "json.load"), None)
    print(markdown_table(["case", "time s", "peak RSS MiB", "time / json.load", "RSS / json.load", "exit"],
                         [[r.case, f"{r.seconds:.1f}", f"{r.peak_rss_mib:.0f}",
                           f"{r.seconds / ref.seconds:.2f}" if ref else None,
                           f"{r.peak_rss_mib / ref.peak_rss_mib:.3f}" if ref else None, r.exit_status] for r in rows]))
    if args.json:
        results.write(args.json, meta, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

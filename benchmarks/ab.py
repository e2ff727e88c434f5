"""A/B of two source trees: one benchmark command run in subprocesses, the trees in the harness's rounds (A B,
B A, ...; no warm-up round: each run is its own process).

Each round runs the command once per tree, in that tree (``cwd`` and ``PYTHONPATH`` = the tree, so each side runs
its own code and its own copy of the benchmark), writing ``--json``. At the end one table: per (suite, cell,
candidate), each tree's mean E2E ms over the rounds, the spread across rounds, and the ratio B / A (rows with an
``e2e_ms``: ``benchmarks.suites``, or a tree's ``scripts/bench_rollout.py`` before it moved). Used for the layout
change (issue 13): the old commit's tree against the new one.

  python -m benchmarks.ab --tree old=.ab/old --tree new=. --rounds 3 --out $OUT/ab -- \
      -m benchmarks.suites --suite seed004 --repeats 1
  python -m benchmarks.ab --tree old=.ab/80a6322 --tree new=. --out $OUT/ab -- scripts/bench_rollout.py --suite seed004
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

from benchmarks.harness import results
from benchmarks.harness.meta import run_meta
from benchmarks.harness.rounds import Rounds, run_rounds
from benchmarks.harness.table import markdown_table


def run_round(label: str, tree: str, command: list[str], out_dir: str, index: int) -> str:
    path = os.path.abspath(os.path.join(out_dir, f"{label}-{index}.json"))
    paths = [os.path.abspath(tree)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    start = time.time()
    proc = subprocess.run([sys.executable, *command, "--json", path], cwd=tree, env=env, capture_output=True,
                          text=True)
    print(f"# {label} round {index}: rc={proc.returncode} {time.time() - start:.0f} s", flush=True)
    with open(os.path.join(out_dir, f"{label}-{index}.log"), "w") as log:
        log.write(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    if proc.returncode != 0:
        print(proc.stderr[-3000:], flush=True)
    return path


def load_rows(path: str) -> list[dict]:
    """A round's rows (none when the run wrote no file)."""
    return results.read(path).rows if os.path.exists(path) else []


@dataclass
class AbRow:
    suite: str
    cell: str
    candidate: str
    ms: dict
    """Tree label -> the E2E ms of each round, in round order."""


def summarize(paths: dict[str, list[str]]) -> list[AbRow]:
    """Per key, each tree's per-round E2E ms (a round's value for a key: its row's ``e2e_ms``)."""
    table: dict[tuple, dict[str, list[float]]] = {}
    for label, files in paths.items():
        for path in files:
            for row in load_rows(path):
                value = row.get("e2e_ms")
                if isinstance(value, (int, float)) and value == value:
                    key = (row.get("suite"), row.get("cell"), row.get("candidate"))
                    table.setdefault(key, {}).setdefault(label, []).append(float(value))
    return [AbRow(*key, ms) for key, ms in table.items()]


def format_table(rows: list[AbRow], labels: list[str]) -> str:
    a, b = labels
    cells = []
    for row in rows:
        spread = []
        for label in labels:
            values = row.ms.get(label, [])
            spread.append(f"{statistics.mean(values):.2f} ({min(values):.2f}-{max(values):.2f}; n={len(values)})"
                          if values else None)
        ma, mb = (statistics.mean(row.ms[x]) if row.ms.get(x) else None for x in labels)
        cells.append([row.suite, row.cell, row.candidate, *spread, f"{mb / ma:.3f}" if ma and mb else None])
    return markdown_table(["suite", "cell", "candidate", f"{a} ms (mean; min-max over rounds)", f"{b} ms", f"{b} / {a}"],
                          cells)


def main(argv=None) -> list[AbRow]:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ab", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", required=True, help="LABEL=PATH, exactly two")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", required=True, help="directory for each round's JSON and log")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="-- SCRIPT ARGS or -- -m MODULE ARGS (run with this python)")
    args = parser.parse_args(argv)
    trees = [t.split("=", 1) for t in args.tree]
    if len(trees) != 2 or any(len(t) != 2 for t in trees):
        parser.error("--tree: give exactly two LABEL=PATH")
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    os.makedirs(args.out, exist_ok=True)
    paths: dict[str, list[str]] = {label: [] for label, _ in trees}
    tree_of = dict(trees)
    run_rounds(list(tree_of), Rounds(args.rounds, warmup=0), lambda label, seed, timed: paths[label].append(
        run_round(label, tree_of[label], command, args.out, len(paths[label]))))
    rows = summarize(paths)
    meta = run_meta("ab", argv, trees=tree_of, rounds=args.rounds)
    results.write(os.path.join(args.out, "ab.json"), meta, rows)
    print(format_table(rows, list(tree_of)))
    return rows


if __name__ == "__main__":
    main()

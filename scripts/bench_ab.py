#!/usr/bin/env python
"""A/B of two source trees: one benchmark command run in alternating subprocesses (A B A B ...).

Each round runs the command once per tree, in that tree (``cwd`` and ``PYTHONPATH`` = the tree, so each
side runs its own code and its own copy of the benchmark script), writing ``--json``. At the end one table:
per (suite, cell, candidate), each tree's mean E2E ms over the rounds, the spread across rounds, and the
ratio B / A. Used for the layout change (issue 13): the old commit's tree against the new one.

  python scripts/bench_ab.py --tree old=.ab/old --tree new=. --rounds 3 --out $OUT/ab -- \
      scripts/bench_rollout.py --suite seed004 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


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
    if not os.path.exists(path):
        return []
    with open(path) as f:
        data = json.load(f)
    return data["rows"] if isinstance(data, dict) else data


def summarize(results: dict[str, list[str]]) -> list[dict]:
    """Per key, each tree's per-round E2E ms (a round's value for a key: its row's ``e2e_ms``)."""
    table: dict[tuple, dict[str, list[float]]] = {}
    for label, paths in results.items():
        for path in paths:
            for row in load_rows(path):
                value = row.get("e2e_ms")
                if isinstance(value, (int, float)) and value == value:
                    key = (row.get("suite"), row.get("cell"), row.get("candidate"))
                    table.setdefault(key, {}).setdefault(label, []).append(float(value))
    return [{"suite": k[0], "cell": k[1], "candidate": k[2], "ms": v} for k, v in table.items()]


def print_table(rows: list[dict], labels: list[str]) -> None:
    a, b = labels
    print(f"| suite | cell | candidate | {a} ms (mean; min-max over rounds) | {b} ms | {b} / {a} |")
    print("|---|---|---|---:|---:|---:|")
    for row in rows:
        cells = []
        for label in labels:
            values = row["ms"].get(label, [])
            cells.append(f"{statistics.mean(values):.2f} ({min(values):.2f}-{max(values):.2f}; n={len(values)})"
                         if values else "-")
        ma, mb = (statistics.mean(row["ms"][x]) if row["ms"].get(x) else None for x in labels)
        ratio = f"{mb / ma:.3f}" if ma and mb else "-"
        print(f"| {row['suite']} | {row['cell']} | {row['candidate']} | {cells[0]} | {cells[1]} | {ratio} |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", required=True, help="LABEL=PATH, exactly two")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", required=True, help="directory for each round's JSON and log")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS (run with this python)")
    args = parser.parse_args(argv)
    trees = [t.split("=", 1) for t in args.tree]
    if len(trees) != 2 or any(len(t) != 2 for t in trees):
        parser.error("--tree: give exactly two LABEL=PATH")
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    os.makedirs(args.out, exist_ok=True)
    results: dict[str, list[str]] = {label: [] for label, _ in trees}
    for index in range(args.rounds):
        for label, tree in (trees if index % 2 == 0 else trees[::-1]):  # A B, then B A: drift hits both
            results[label].append(run_round(label, tree, command, args.out, index))
    rows = summarize(results)
    with open(os.path.join(args.out, "ab.json"), "w") as f:
        json.dump({"trees": dict(trees), "command": command, "rounds": args.rounds, "rows": rows}, f, indent=1)
    print_table(rows, [label for label, _ in trees])


if __name__ == "__main__":
    main()

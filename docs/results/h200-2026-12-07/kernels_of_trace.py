"""The GPU kernels of one profiled rollout call (a Chrome trace of `benchmarks.rl --busy on --trace-dir`), summed by
kernel name and launch grid, per decode step: where the call's GPU time goes, next to the synthetic decode step's
kernel table (BENCHMARKS.md section 1). Usage, from the repository root: python
docs/results/h200-2026-12-07/kernels_of_trace.py TRACE.json STEPS [TOP]"""

import json
import re
import sys
from collections import defaultdict

from benchmarks.rl.busy import GPU_EVENT_KINDS
from benchmarks.rl.figures import union_length


def short(name: str) -> str:
    name = re.sub(r"<.*", "", name)  # template arguments
    name = re.sub(r"\(.*", "", name)
    return name[:70]


def main(path: str, steps: int, top: int) -> None:
    with open(path) as f:
        events = json.load(f).get("traceEvents", [])
    gpu = [e for e in events if e.get("cat") in GPU_EVENT_KINDS and "dur" in e]
    first, last = min(e["ts"] for e in gpu), max(e["ts"] + e["dur"] for e in gpu)
    busy = union_length([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    total = sum(e["dur"] for e in gpu)
    groups = defaultdict(lambda: [0.0, 0])
    for e in gpu:
        args = e.get("args", {})
        key = (short(e["name"]), str(args.get("grid", "")), str(args.get("block", "")))
        groups[key][0] += e["dur"]
        groups[key][1] += 1
    span = last - first
    print(f"# {path}: {len(gpu)} GPU events; span {span / 1e3:.1f} ms, busy {busy / 1e3:.1f} ms "
          f"({100 * busy / span:.1f}%), kernel sum {total / 1e3:.1f} ms; per decode step ({steps}): span "
          f"{span / steps:.1f} us, busy {busy / steps:.1f} us")
    print("| kernel | grid | block | calls | ms | us a step | share of kernel sum |")
    print("|---|---|---|---:|---:|---:|---:|")
    for (name, grid, block), (dur, n) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"| {name} | {grid} | {block} | {n} | {dur / 1e3:.1f} | {dur / steps:.1f} | {100 * dur / total:.1f}% |")
    ranges = defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.get("cat") == "gpu_user_annotation" and "dur" in e:
            ranges[e["name"]][0] += e["dur"]
            ranges[e["name"]][1] += 1
    if ranges:
        print("\n| GPU range (our stages) | count | ms |\n|---|---:|---:|")
        for name, (dur, n) in sorted(ranges.items(), key=lambda kv: -kv[1][0]):
            print(f"| {name} | {n} | {dur / 1e3:.1f} |")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 40)

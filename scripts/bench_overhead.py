#!/usr/bin/env python
"""Per-call cost of ``stage()`` in each profiling mode (micro-benchmark; not a test).

Each case runs ``with stage(stages.DECODE): pass`` ``--calls`` times; the cost per call is the loop
time minus an empty loop's, over ``--calls``. Cases that need no open session are interleaved
round-robin over ``--repeats``; the in-session case runs in its own block (its torch.profiler
session stays open across its repeats). Median and min over repeats, in ns per call.

Cases:
  off                 OPSD_PROFILE unset: the shared do-nothing range
  off @staged         a @staged function call minus a plain function call
  nvtx                NVTX ranges (no tool attached unless run under nsys) + profiler check
  1 outside           mode 1 with nobody recording (what non-recorded steps pay per stage)
  1 + collect_stages  mode 1 inside collect_stages() with no session (timers; CUDA events on GPU)
  1 inside recorded   mode 1 inside a recorded step: timers + record_function under torch.profiler
  timers inside step  mode timers (the always-on light mode) inside a timed step: NVTX + host timer +
                      two CUDA events per call on GPU (no memory reads, no profiler)
  ref record_function torch.profiler.record_function with no profiler running (for comparison)
  ref nvtx.annotate   nvtx.annotate with the opsd domain (for comparison; needs nvtx)

The lead extends this script with the rollout end-to-end comparison.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time

import torch

from instrumentation import ProfileConfig, configure, stages
from instrumentation.collect import collect_stages
from instrumentation.profiler import opsd_profiler
from instrumentation.ranges import stage, staged

NAME = stages.DECODE


def _empty(n: int) -> int:
    t0 = time.perf_counter_ns()
    for _ in range(n):
        pass
    return time.perf_counter_ns() - t0


def _stage_loop(n: int) -> int:
    open_stage, name = stage, NAME
    t0 = time.perf_counter_ns()
    for _ in range(n):
        with open_stage(name):
            pass
    return time.perf_counter_ns() - t0


def _plain() -> None:
    pass


@staged(NAME)
def _decorated() -> None:
    pass


def _call_loop(fn, n: int) -> int:
    t0 = time.perf_counter_ns()
    for _ in range(n):
        fn()
    return time.perf_counter_ns() - t0


def _ctx_loop(make, n: int) -> int:
    t0 = time.perf_counter_ns()
    for _ in range(n):
        with make():
            pass
    return time.perf_counter_ns() - t0


def _nvtx_annotate():
    try:
        import nvtx
    except ImportError:
        return None
    return lambda: nvtx.annotate("opsd/decode", color=stages.STAGE_COLORS[NAME], domain=stages.NVTX_DOMAIN)


def _interleaved_cases(n: int):
    """name -> callable returning the ns per call for one repeat (modes re-configured per call)."""
    def in_mode(mode, body):
        def run():
            configure(ProfileConfig(mode=mode))
            return (body() - _empty(n)) / n
        return run

    def collected():
        with collect_stages():
            return _stage_loop(n)

    cases = {
        "off": in_mode("0", lambda: _stage_loop(n)),
        "off @staged": in_mode("0", lambda: _call_loop(_decorated, n) - _call_loop(_plain, n) + _empty(n)),
        "nvtx": in_mode("nvtx", lambda: _stage_loop(n)),
        "1 outside": in_mode("1", lambda: _stage_loop(n)),
        "1 + collect_stages": in_mode("1", collected),
        "ref record_function": in_mode("0", lambda: _ctx_loop(lambda: torch.profiler.record_function(
            "opsd/decode"), n)),
    }
    annotate = _nvtx_annotate()
    if annotate is not None:
        cases["ref nvtx.annotate"] = in_mode("0", lambda: _ctx_loop(annotate, n))
    return cases


def _inside_recorded_step(n: int, repeats: int) -> list[float]:
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        config = ProfileConfig(mode="1", output_dir=tmp, steps=(0,), profile_memory=False)
        with opsd_profiler(config, rank=0, world_size=1):
            for _ in range(repeats):
                results.append((_stage_loop(n) - _empty(n)) / n)
    configure(ProfileConfig(mode="0"))
    return results


def _inside_timed_step(n: int, repeats: int) -> list[float]:
    """Mode ``timers``: one timed step per repeat (``prof.step()`` outside the measured loop)."""
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        config = ProfileConfig(mode="timers", output_dir=tmp)
        with opsd_profiler(config, rank=0, world_size=1) as prof:
            for _ in range(repeats):
                results.append((_stage_loop(n) - _empty(n)) / n)
                prof.step()
    configure(ProfileConfig(mode="0"))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20_000, help="stage() calls per repeat")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--inside-calls", type=int, default=2_000,
                        help="calls per repeat inside the recorded step (each one is a trace event)")
    args = parser.parse_args()

    samples: dict[str, list[float]] = {}
    cases = _interleaved_cases(args.calls)
    for case in cases.values():  # warm-up
        case()
    for _ in range(args.repeats):
        for name, case in cases.items():
            samples.setdefault(name, []).append(case())
    samples["1 inside recorded"] = _inside_recorded_step(args.inside_calls, args.repeats)
    samples["timers inside step"] = _inside_timed_step(args.inside_calls, args.repeats)

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    print(f"# stage() per-call cost  (torch {torch.__version__}, {device}, python {platform.python_version()}, "
          f"{args.repeats} repeats x {args.calls} calls; in-session {args.inside_calls})")
    print("| case | median ns/call | min ns/call |")
    print("| --- | ---: | ---: |")
    for name, values in samples.items():
        print(f"| {name} | {statistics.median(values):,.0f} | {min(values):,.0f} |")


if __name__ == "__main__":
    main()

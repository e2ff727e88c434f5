"""The GPU-busy column: one extra call of a candidate under torch.profiler, its GPU activity over its own wall."""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

import torch

from benchmarks.rl.figures import busy_percent

GPU_EVENT_KINDS = ("kernel", "gpu_memcpy", "gpu_memset")
#: Set once a profiled call has run in this process: Kineto may leave CUPTI callbacks installed afterwards
#: (pytorch/pytorch#144455), so later timed calls say so in their row (``after_profile``).
PROFILED = {"any": False}


@dataclass(frozen=True)
class BusyOptions:
    """How the profiled call of each candidate runs (``--busy``, ``--busy-max-events``, ...)."""

    max_events: int = 3_000_000
    """Traces with more events are not read (the column says so)."""
    teardown: bool = False
    """Set ``TEARDOWN_CUPTI=1`` around the profiled call (``--cupti-teardown``)."""
    trace_dir: Optional[str] = None
    """Write each profiled call's Chrome trace there, as ``<cell>--<candidate>.json``."""


def trace_file(trace_dir: Optional[str], cell: str, candidate: str) -> Optional[str]:
    """``<trace_dir>/<cell>--<candidate>.json``, the candidate's name made a file name; None without a folder."""
    if not trace_dir:
        return None
    safe = re.sub(r"[^A-Za-z0-9._=-]+", "_", candidate)
    return os.path.join(trace_dir, f"{cell}--{safe}.json")


def gpu_intervals(prof, max_events: int, trace_path: Optional[str] = None) -> tuple[Optional[list], str]:
    """Kernel / memcpy / memset intervals (ns) of a finished torch.profiler session, or (None, why).
    ``trace_path``: write the session's Chrome trace there (a session saves its trace once) and read it back."""
    if trace_path:
        prof.export_chrome_trace(trace_path)
        return _chrome_intervals(trace_path, max_events)
    results = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    # torch 2.11's _KinetoEvent has no activity_type() (2.13's has): read the Chrome trace there instead
    if results is not None and hasattr(torch._C._autograd._KinetoEvent, "activity_type"):
        events = results.events()
        if len(events) > max_events:
            return None, f"n/a (skipped: {len(events)} events > {max_events})"
        out = [(e.start_ns(), e.start_ns() + e.duration_ns()) for e in events if e.activity_type() in GPU_EVENT_KINDS]
        return out, ""
    with tempfile.TemporaryDirectory() as tmp:  # other torch versions: through the Chrome trace
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        return _chrome_intervals(path, max_events)


def _chrome_intervals(path: str, max_events: int) -> tuple[Optional[list], str]:
    with open(path) as f:
        events = json.load(f).get("traceEvents", [])
    if len(events) > max_events:
        return None, f"n/a (skipped: {len(events)} events > {max_events})"
    return [(e["ts"] * 1e3, (e["ts"] + e.get("dur", 0)) * 1e3) for e in events if e.get("cat") in GPU_EVENT_KINDS], ""


def profile_busy(call, device: str, options: BusyOptions, trace_path: Optional[str] = None) -> tuple:
    """``(GPU-busy %, note)`` of one extra profiled ``call()``: its GPU activity over its own wall (both under the
    profiler). ``trace_path``: also record the host (with our stage ranges when ``OPSD_PROFILE`` is on) and write the
    call's Chrome trace there. A profiler failure loses the column, not the row."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU  # CPU: no GPU events
    if cuda:
        torch.cuda.synchronize()
    try:
        PROFILED["any"] = True
        activities = [activity] + ([ProfilerActivity.CPU] if trace_path and activity != ProfilerActivity.CPU else [])
        prof = profile(activities=activities)
        if options.teardown:  # before start and stop: torch resets it where it thinks graphs and teardown clash
            os.environ["TEARDOWN_CUPTI"] = "1"
        with prof:
            start = time.perf_counter_ns()
            call()
            if cuda:
                torch.cuda.synchronize()
            wall_ns = time.perf_counter_ns() - start
            if options.teardown:
                os.environ["TEARDOWN_CUPTI"] = "1"
        intervals, why = gpu_intervals(prof, options.max_events, trace_path)
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as exc:  # the busy column is lost, not the row
        return None, f"n/a (profiler: {type(exc).__name__}: {exc})"[:200]
    if intervals is None:
        return None, why
    if not intervals:
        return None, "n/a (no GPU events recorded)"
    return busy_percent(intervals, wall_ns), f"{len(intervals)} events, profiled call {wall_ns / 1e6:.0f} ms"

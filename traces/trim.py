"""Cut one step out of a Chrome trace (for test data and bug reports); pure functions on event dicts.

The kept step is a ``opsd/step`` range (``stage``): by default the last one. Kept events:

- metadata events (``"ph": "M"``) and the document's top-level keys;
- ``user_annotation`` ranges inside the step's window, and those around it (``ProfilerStep#N``
  keeps the training step index);
- every other CPU-side event that starts inside the window (``cuda_runtime`` / ``cuda_driver``
  launches and syncs, ``cpu_op``, ``python_function`` ...);
- the GPU ops (kernels, copies, sets) and flow arrows of the kept launches, whatever their time, and
  GPU ops without a launch in the file that overlap the window;
- ``[memory]`` samples inside the window plus the last one before it on each (process, device);
- ``Trace`` span events, clipped to the kept events.
"""

from __future__ import annotations

import re

_GPU_CATS = frozenset(("kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"))
_LAUNCH_CATS = frozenset(("cuda_runtime", "cuda_driver"))
_PROFILER_STEP = re.compile(r"^ProfilerStep#(\d+)$")
#: Categories dropped, in this order, while the output is larger than asked.
DROP_ORDER = ("python_function", "cpu_op", "cpu_instant_event", "ac2g", "fwdbwd")


def step_ranges(events: list[dict], stage: str) -> list[dict]:
    """The ``stage`` ranges of the trace, in time order."""
    found = [e for e in events if e.get("cat") == "user_annotation" and e.get("name") == stage
             and e.get("ph") == "X"]
    return sorted(found, key=lambda e: float(e["ts"]))


def step_index(events: list[dict], step: dict) -> int | None:
    """The N of the ``ProfilerStep#N`` range around ``step`` (None without one)."""
    lo, hi = float(step["ts"]), float(step["ts"]) + float(step["dur"])
    for e in events:
        m = _PROFILER_STEP.match(str(e.get("name", "")))
        if m and e.get("ph") == "X" and e.get("pid") == step.get("pid") \
                and float(e["ts"]) <= lo and hi <= float(e["ts"]) + float(e["dur"]):
            return int(m.group(1))
    return None


def _is_memory(e: dict) -> bool:
    return e.get("name") == "[memory]"


def _cpu_keep(e: dict, lo: float, hi: float) -> bool:
    ts = float(e.get("ts", lo - 1))
    if e.get("cat") == "user_annotation" and e.get("ph") == "X":
        end = ts + float(e.get("dur", 0))
        return (lo <= ts and end <= hi) or (ts <= lo and hi <= end)
    return lo <= ts <= hi


def _memory_before(events: list[dict], lo: float) -> list[dict]:
    last: dict[tuple, dict] = {}
    for e in events:
        if _is_memory(e) and float(e["ts"]) < lo:
            args = e.get("args") or {}
            key = (e.get("pid"), args.get("Device Type"), args.get("Device Id"))
            if key not in last or float(e["ts"]) >= float(last[key]["ts"]):
                last[key] = e
    return list(last.values())


def trim_events(events: list[dict], step: dict) -> list[dict]:
    """The events of one step (see the module docstring), in their original order."""
    lo, hi = float(step["ts"]), float(step["ts"]) + float(step["dur"])
    kept, corr = [], set()
    gpu, flows, spans = [], [], []
    for e in events:
        cat = e.get("cat")
        if e.get("ph") == "M":
            kept.append(e)
        elif cat in _GPU_CATS:
            gpu.append(e)
        elif cat in ("ac2g", "fwdbwd") or e.get("ph") in ("s", "f"):
            flows.append(e)
        elif cat == "Trace":
            spans.append(e)
        elif _cpu_keep(e, lo, hi):
            kept.append(e)
            if cat in _LAUNCH_CATS and (e.get("args") or {}).get("correlation") is not None:
                corr.add(e["args"]["correlation"])
    launched = {c for e in events if e.get("cat") in _LAUNCH_CATS
                for c in [(e.get("args") or {}).get("correlation")] if c is not None}
    for e in gpu:
        c = (e.get("args") or {}).get("correlation")
        overlaps = float(e["ts"]) <= hi and float(e["ts"]) + float(e.get("dur", 0)) >= lo
        if c in corr or (c not in launched and overlaps):
            kept.append(e)
    kept += [e for e in flows if e.get("id") in corr] + _memory_before(events, lo)
    order = {id(e): i for i, e in enumerate(events)}
    return sorted(kept, key=lambda e: order[id(e)]) + _clip_spans(spans, kept)


def _clip_spans(spans: list[dict], kept: list[dict]) -> list[dict]:
    times = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in kept if "ts" in e]
    if not times:
        return []
    lo, hi = min(t[0] for t in times), max(t[1] for t in times)
    return [dict(e, ts=lo, dur=hi - lo) for e in spans]


def drop_categories(events: list[dict], categories) -> list[dict]:
    """``events`` without those of ``categories`` (``cpu_instant_event`` keeps ``[memory]``)."""
    drop = set(categories)
    return [e for e in events if e.get("cat") not in drop or _is_memory(e)]

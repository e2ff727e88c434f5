"""Decoding of single Chrome-trace events into the tuples of :mod:`traces.events`.

Two paths: :func:`fast_tuple` reads an event written in Kineto's exact layout with one anchored
regex (no JSON decoding); :func:`event_tuple` takes any decoded event object. Both give the same
tuple for the same event. :func:`metadata` reads top-level keys (``distributedInfo.rank``).
"""

from __future__ import annotations

import json
import re
from typing import Iterator

from traces.events import GPU, LAUNCH, MEMORY, META, RANGE, SPAN

_GPU_CATS = frozenset(("kernel", "gpu_memcpy", "gpu_memset"))
_LAUNCH_CATS = frozenset(("cuda_runtime", "cuda_driver"))


def event_tuple(ev: dict):
    """The compact tuple of a decoded event, None for events the report does not use."""
    cat = ev.get("cat")
    if cat == "user_annotation":
        if ev.get("ph") == "X":
            return (RANGE, str(ev["name"]), ev["pid"], ev["tid"], float(ev["ts"]), float(ev["dur"]))
        return None
    if cat in _GPU_CATS:
        args = ev.get("args") or {}
        return (GPU, int(args["correlation"]), float(ev["ts"]), float(ev["dur"]), args.get("device"))
    if cat in _LAUNCH_CATS:
        corr = (ev.get("args") or {}).get("correlation")
        if corr is None:
            return None
        return (LAUNCH, ev["pid"], ev["tid"], float(ev["ts"]), int(corr))
    if ev.get("name") == "[memory]":
        args = ev["args"]
        return (MEMORY, ev["pid"], float(ev["ts"]), int(args.get("Device Type", 0)),
                int(args.get("Device Id", -1)), int(args.get("Total Allocated", 0)),
                int(args.get("Total Reserved", 0)))
    if cat == "Trace" and ev.get("ph") == "X":
        return (SPAN, float(ev["ts"]), float(ev["dur"]))
    return None


def metadata(path: str, text: str) -> Iterator[tuple]:
    """META tuples from a top-level object fragment (``{...}`` text); bad fragments are ignored."""
    try:
        meta = json.loads(text)
    except ValueError:
        return
    info = meta.get("distributedInfo") if isinstance(meta, dict) else None
    if isinstance(info, dict) and isinstance(info.get("rank"), int):
        yield (META, "rank", info["rank"])


_INT = re.compile(r"\s*(-?\d+)")


_NUM = r"(-?[\d.]+(?:[eE][-+]?\d+)?)"
#: Kineto's exact layout of launches and GPU ops, up to the start of their args.
_KINETO_OP = re.compile(
    r'\{\s*"ph":\s*"X",\s*"cat":\s*"(kernel|gpu_memcpy|gpu_memset|cuda_runtime|cuda_driver)",'
    r'\s*"name":\s*"[^"\\]*+(?:\\.[^"\\]*+)*+",\s*"pid":\s*(-?\d+),\s*"tid":\s*(-?\d+),'
    r'\s*"ts":\s*' + _NUM + r',\s*"dur":\s*' + _NUM + r'\s*,\s*"args":\s*\{')
#: Kineto's exact layout of allocator samples, up to the device fields.
_KINETO_MEMORY = re.compile(
    r'\{\s*"ph":\s*"i",\s*"cat":\s*"cpu_instant_event",\s*"s":\s*"t",\s*"name":\s*"\[memory\]",'
    r'\s*"pid":\s*(-?\d+),\s*"tid":\s*-?\d+,\s*"ts":\s*' + _NUM + r'\s*,\s*"args":\s*\{'
    r'\s*"Total Reserved":\s*(-?\d+),\s*"Total Allocated":\s*(-?\d+),\s*"Bytes":\s*-?\d+,'
    r'\s*"Device Id":\s*(-?\d+),\s*"Device Type":\s*(-?\d+)')


def fast_tuple(buf: str, s: int):
    """The tuple of a kineto-layout launch, GPU op or memory sample at ``buf[s]``, else None."""
    m = _KINETO_OP.match(buf, s)
    if m is not None:
        cat, pid, tid, ts, dur = m.groups()
        c = buf.find('"correlation":', m.end(), buf.find("}", m.end()))
        corr = _INT.match(buf, c + 14) if c > 0 else None
        if corr is None:
            return None
        corr = corr.group(1)
        if cat[0] == "c":
            return (LAUNCH, int(pid), int(tid), float(ts), int(corr))
        return (GPU, int(corr), float(ts), float(dur), int(pid))
    m = _KINETO_MEMORY.match(buf, s)
    if m is not None:
        pid, ts, reserved, alloc, dev_id, dev_type = m.groups()
        return (MEMORY, int(pid), float(ts), int(dev_type), int(dev_id), int(alloc), int(reserved))
    return None

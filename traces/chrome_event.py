"""Decoding of single Chrome-trace events into the tuples of :mod:`traces.events`.

Two paths: :func:`fast_tuple` reads an event written in Kineto's exact layout with one anchored
regex (no JSON decoding); :func:`event_tuple` takes any decoded event object. Both give the same
tuple for the same event. :func:`meta_tuples` reads top-level keys (``distributedInfo.rank``).
"""

from __future__ import annotations

import json
import re
from typing import Iterator

from traces.bad import BAD, BadEvent, example, integer, number
from traces.events import GPU, LAUNCH, MEMORY, META, OP, RANGE, SPAN, SYNC, SYNC_CALLS, is_sync_call

_GPU_CATS = frozenset(("kernel", "gpu_memcpy", "gpu_memset"))
_LAUNCH_CATS = frozenset(("cuda_runtime", "cuda_driver"))


def event_tuple(ev: dict):
    """The compact tuple of a decoded event, None for events the report does not use.

    Raises :class:`~traces.bad.BadEvent` (or ``KeyError`` / ``TypeError`` ...) for a used event
    whose fields cannot be used: ids must be integers, times numbers, names strings.
    """
    cat = ev.get("cat")
    if cat == "user_annotation":
        if ev.get("ph") == "X":
            return (RANGE, _name(ev), integer(ev["pid"], "pid"), integer(ev["tid"], "tid"),
                    number(ev["ts"], "ts"), number(ev["dur"], "dur"))
        return None
    if cat == "cpu_op":
        if ev.get("ph") == "X":
            return (OP, _name(ev), integer(ev["pid"], "pid"), integer(ev["tid"], "tid"), number(ev["ts"], "ts"),
                    number(ev["dur"], "dur"))
        return None
    if cat in _GPU_CATS:
        args = _args(ev)
        stream = args.get("stream")
        return (GPU, integer(args["correlation"], "correlation"), number(ev["ts"], "ts"),
                number(ev["dur"], "dur"), args.get("device"), _name(ev, ""),
                integer(stream, "stream") if stream is not None else -1)
    if cat in _LAUNCH_CATS:
        if is_sync_call(ev.get("name")):
            return (SYNC, integer(ev["pid"], "pid"), integer(ev["tid"], "tid"), number(ev["ts"], "ts"),
                    number(ev["dur"], "dur"))
        corr = _args(ev).get("correlation")
        if corr is None:
            return None
        return (LAUNCH, integer(ev["pid"], "pid"), integer(ev["tid"], "tid"), number(ev["ts"], "ts"),
                integer(corr, "correlation"))
    if ev.get("name") == "[memory]":
        args = _args(ev)
        return (MEMORY, integer(ev["pid"], "pid"), number(ev["ts"], "ts"),
                integer(args.get("Device Type", 0), "Device Type"), integer(args.get("Device Id", -1), "Device Id"),
                integer(args.get("Total Allocated", 0), "Total Allocated"),
                integer(args.get("Total Reserved", 0), "Total Reserved"))
    if cat == "Trace" and ev.get("ph") == "X":
        return (SPAN, number(ev["ts"], "ts"), number(ev["dur"], "dur"))
    return None


def _name(ev: dict, default=None) -> str:
    name = ev["name"] if default is None else ev.get("name", default)
    if not isinstance(name, str):
        raise BadEvent("name not a string")
    return name


def _args(ev: dict) -> dict:
    args = ev.get("args")
    if args is None:
        return {}
    if not isinstance(args, dict):
        raise BadEvent("args not an object")
    return args


def decoded_tuple(ev):
    """:func:`event_tuple` of a decoded event, with a ``(BAD, reason, example)`` tuple in place of
    any error (an event that cannot be used never stops the file)."""
    if not isinstance(ev, dict):
        return None
    try:
        return event_tuple(ev)
    except BadEvent as exc:
        reason = exc.reason
    except KeyError as exc:
        reason = f"no {exc.args[0]!r} field" if exc.args and isinstance(exc.args[0], str) else "a missing field"
    except Exception as exc:  # noqa: BLE001 - one event, whatever went wrong with it
        reason = f"fields of the wrong type ({type(exc).__name__})"
    return (BAD, reason, example(ev.get("name"), ev.get("ts")))


def meta_tuples(meta) -> Iterator[tuple]:
    """META tuples of the decoded top-level keys of a trace (``distributedInfo``)."""
    info = meta.get("distributedInfo") if isinstance(meta, dict) else None
    if info is None:
        return
    if not isinstance(info, dict):
        yield (META, "note", "distributedInfo is not an object; rank taken from the file name or position")
        return
    rank, size = info.get("rank"), info.get("world_size")
    size_ok = type(size) is int and size >= 1
    if size is not None and not size_ok:
        yield (META, "note", f"distributedInfo.world_size {_short(size)} is not an integer >= 1; ignored")
    if rank is None:
        return
    if type(rank) is not int or rank < 0:
        yield (META, "note", f"distributedInfo.rank {_short(rank)} is not an integer >= 0; rank taken from the file "
                             "name or position")
        return
    if size_ok and rank >= size:
        yield (META, "note", f"distributedInfo.rank {rank} is not below distributedInfo.world_size {size}; "
                             f"rank {rank} used")
    yield (META, "rank", rank)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:36] + " ..."


_INT = re.compile(r"\s*(-?\d+)")


#: Kineto's args of GPU ops (stream, then correlation) and of launches (correlation), from ``{``.
_GPU_ARGS = re.compile(r'[^{}]*?"stream":\s*(-?\d+),\s*"correlation":\s*(-?\d+)')
_LAUNCH_ARGS = re.compile(r'[^{}]*?"correlation":\s*(-?\d+)')


def _int_arg(buf: str, key: str, lo: int):
    """The integer value of ``key`` (``'"name":'``) in the args object starting at ``buf[lo]``."""
    at = buf.find(key, lo, buf.find("}", lo))
    m = _INT.match(buf, at + len(key)) if at > 0 else None
    return int(m.group(1)) if m is not None else None


_NUM = r"(-?[\d.]+(?:[eE][-+]?\d+)?)"
#: Kineto's exact layout of operators, launches and GPU ops, up to the start of their args.
_KINETO_OP = re.compile(
    r'\{\s*"ph":\s*"X",\s*"cat":\s*"(kernel|gpu_memcpy|gpu_memset|cuda_runtime|cuda_driver|cpu_op)",'
    r'\s*"name":\s*"([^"\\]*+(?:\\.[^"\\]*+)*+)",\s*"pid":\s*(-?\d+),\s*"tid":\s*(-?\d+),'
    r'\s*"ts":\s*' + _NUM + r',\s*"dur":\s*' + _NUM + r'\s*,\s*"args":\s*\{')
#: Kineto's exact layout of allocator samples, up to the device fields.
_KINETO_MEMORY = re.compile(
    r'\{\s*"ph":\s*"i",\s*"cat":\s*"cpu_instant_event",\s*"s":\s*"t",\s*"name":\s*"\[memory\]",'
    r'\s*"pid":\s*(-?\d+),\s*"tid":\s*-?\d+,\s*"ts":\s*' + _NUM + r'\s*,\s*"args":\s*\{'
    r'\s*"Total Reserved":\s*(-?\d+),\s*"Total Allocated":\s*(-?\d+),\s*"Bytes":\s*-?\d+,'
    r'\s*"Device Id":\s*(-?\d+),\s*"Device Type":\s*(-?\d+)')


def fast_tuple(buf: str, s: int):
    """The tuple of a kineto-layout launch, GPU op or memory sample at ``buf[s]``, else None (also
    when a number of the layout does not convert: the JSON decoder then has the last word)."""
    try:
        return _fast_tuple(buf, s)
    except ValueError:  # e.g. "ts": 1.2.3 matched by the layout's number pattern
        return None


def _fast_tuple(buf: str, s: int):
    m = _KINETO_OP.match(buf, s)
    if m is not None:
        cat, name, pid, tid, ts, dur = m.groups()
        if "\\" in name:
            name = json.loads('"' + name + '"')
        if cat == "cpu_op":
            return (OP, name, int(pid), int(tid), float(ts), float(dur))
        if cat[0] == "c" and name in SYNC_CALLS:
            return (SYNC, int(pid), int(tid), float(ts), float(dur))
        if cat[0] == "c":
            a = _LAUNCH_ARGS.match(buf, m.end())
            corr = int(a.group(1)) if a is not None else _int_arg(buf, '"correlation":', m.end())
            return None if corr is None else (LAUNCH, int(pid), int(tid), float(ts), corr)
        a = _GPU_ARGS.match(buf, m.end())
        if a is not None:
            return (GPU, int(a.group(2)), float(ts), float(dur), int(pid), name, int(a.group(1)))
        corr = _int_arg(buf, '"correlation":', m.end())
        if corr is None:
            return None
        stream = _int_arg(buf, '"stream":', m.end())
        return (GPU, corr, float(ts), float(dur), int(pid), name, -1 if stream is None else stream)
    m = _KINETO_MEMORY.match(buf, s)
    if m is not None:
        pid, ts, reserved, alloc, dev_id, dev_type = m.groups()
        return (MEMORY, int(pid), float(ts), int(dev_type), int(dev_id), int(alloc), int(reserved))
    return None

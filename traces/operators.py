"""Host operator calls (``cpu_op`` events), kept bounded, and the calls far slower than they should be.

Per file, :class:`OpCalls` (filled by :func:`traces.events.collect`) keeps:

- per operator name: its number of calls and a histogram of their host times (bins 2^(1/16) apart, ~4.4%), whose
  lower median stands for the operator's usual host time per call;
- every call of at least :data:`LONG_CALL_US` in full (name, process, thread, start, end): only such a call can be
  slow (below); a thread holds at most one per ms and nesting level, so their number follows the traced time, not
  the number of events;
- per process, the union of its operator calls (host time inside PyTorch operators), merged as the calls arrive.

A long call is **slow** (:func:`slow_calls`) when its host time (duration minus the host's sync waits in it) is at
least :data:`LONG_CALL_US`, the GPU idled at least half of it (the host held the GPU up, rather than waiting for
queued work), and either rule holds:

- ``median``: it is at least :data:`SLOW_FACTOR` times its operator's median host time;
- ``gpu``: it launched GPU work and is at least :data:`SLOW_FACTOR` times the larger of that work's busy time and
  :data:`LAUNCH_HOST_US` per launch (so an operator that is slow because it launches many kernels is not one).

Its excess is its host time minus the smaller reference of the rules that hold (the median, or its GPU time), at
most the GPU's idle time during it. Of nested slow calls only the innermost that holds at least half of an outer
call's excess is kept (``aten::_cudnn_attention_forward``, not the ``aten::scaled_dot_product_attention`` around it).
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass

import numpy as np

from traces.records import SlowOperator

#: Only calls at least this long (host time, us) are kept in full and can be slow.
LONG_CALL_US = 1000.0
#: A slow call is at least this many times its reference (median, or GPU time).
SLOW_FACTOR = 10.0
#: Host time per launch (us) that launching alone may take: an operator's reference is at least this per launch.
LAUNCH_HOST_US = 50.0
#: The GPU must idle at least this fraction of a call for it to be slow.
IDLE_FRACTION = 0.5
#: Histogram bins per factor of 2 of host time.
BINS_PER_OCTAVE = 16


def _bin(dur_us: float) -> int:
    return int(math.floor(math.log2(dur_us) * BINS_PER_OCTAVE)) if dur_us > 0 else -(1 << 30)


def bin_value(b: int) -> float:
    """The host time (us) a histogram bin stands for: its geometric centre (0 for zero-length calls)."""
    return 0.0 if b == -(1 << 30) else 2.0 ** ((b + 0.5) / BINS_PER_OCTAVE)


def lower_median(hist: dict[int, int]) -> float:
    """The lower median (us) of a histogram of host times (0 when empty)."""
    n = sum(hist.values())
    if n == 0:
        return 0.0
    rank, seen = (n + 1) // 2, 0
    for b in sorted(hist):
        seen += hist[b]
        if seen >= rank:
            return bin_value(b)
    return 0.0  # pragma: no cover - unreachable


class OpCalls:
    """The bounded record of one file's operator calls (see the module docstring)."""

    def __init__(self):
        self.names: list[str] = []
        self._ids: dict[str, int] = {}
        self.hists: list[dict[int, int]] = []
        #: the long calls: name id, pid, tid, start, end
        self.long_name = array("q")
        self.long_pid = array("q")
        self.long_tid = array("q")
        self.long_start_us = array("d")
        self.long_end_us = array("d")
        #: pid -> (starts, ends) of the union of its calls, merged while in time order
        self.cover: dict[int, tuple[array, array]] = {}

    def __len__(self) -> int:
        return sum(sum(h.values()) for h in self.hists)

    def add(self, name: str, pid: int, tid: int, start_us: float, dur_us: float) -> None:
        """Record one call."""
        nid = self._ids.get(name)
        if nid is None:
            nid = self._ids[name] = len(self.names)
            self.names.append(name)
            self.hists.append({})
        hist, b = self.hists[nid], _bin(dur_us)
        hist[b] = hist.get(b, 0) + 1
        end = start_us + dur_us
        if dur_us >= LONG_CALL_US:
            self.long_name.append(nid), self.long_pid.append(pid), self.long_tid.append(tid)
            self.long_start_us.append(start_us), self.long_end_us.append(end)
        cover = self.cover.get(pid)
        if cover is None:
            self.cover[pid] = (array("d", [start_us]), array("d", [end]))
            return
        starts, ends = cover
        if starts[-1] <= start_us <= ends[-1]:
            if end > ends[-1]:
                ends[-1] = end
        else:
            starts.append(start_us), ends.append(end)

    def count(self, name: str) -> int:
        nid = self._ids.get(name)
        return 0 if nid is None else sum(self.hists[nid].values())

    def hist(self, name: str) -> dict[int, int]:
        nid = self._ids.get(name)
        return {} if nid is None else self.hists[nid]


@dataclass
class SlowCall:
    """One slow operator call (times in us)."""

    name: str
    pid: int
    tid: int
    start_us: float
    end_us: float
    host_us: float
    """Duration minus the host's sync waits in it."""
    gpu_us: float
    """Busy time of the GPU work it launched."""
    launches: int
    median_us: float
    """Its operator's median host time per call (in this file)."""
    rule: str
    """``median`` or ``gpu`` (the rule whose reference is the smaller)."""
    excess_us: float
    inner_us: float = 0.0


def slow_calls(ops: OpCalls, gpu, waits, tolerance_us: float = 0.01) -> list[SlowCall]:
    """The slow calls of one file (module docstring); ``gpu``: its :class:`traces.gpu.GpuOps`, ``waits``: its
    :class:`traces.host.SyncWaits`. Empty without GPU activity."""
    if not gpu.available or not len(ops.long_name):
        return []
    found, medians = [], {}
    for k in range(len(ops.long_name)):
        nid, pid = ops.long_name[k], ops.long_pid[k]
        s, e = ops.long_start_us[k], ops.long_end_us[k]
        host = (e - s) - waits.waited_us(pid, s, e)
        idle = (e - s) - gpu.busy_between(s, e)
        if host < LONG_CALL_US or idle < IDLE_FRACTION * (e - s):
            continue
        if nid not in medians:
            medians[nid] = lower_median(ops.hists[nid])
        busy, launches = gpu.launched_between(pid, s, e)
        refs = []
        if host >= SLOW_FACTOR * medians[nid]:
            refs.append((medians[nid], "median"))
        if launches and host >= SLOW_FACTOR * max(busy, launches * LAUNCH_HOST_US):
            refs.append((busy, "gpu"))
        if refs:
            ref, rule = min(refs)
            found.append(SlowCall(ops.names[nid], pid, ops.long_tid[k], s, e, host, busy, launches, medians[nid],
                                  rule, min(host - ref, idle)))
    return _innermost(found, tolerance_us)


def _innermost(calls: list[SlowCall], tolerance_us: float) -> list[SlowCall]:
    """Drop a slow call when a slow call nested in it (same thread) holds at least half of its excess."""
    by_thread: dict[tuple, list[SlowCall]] = {}
    for c in calls:
        by_thread.setdefault((c.pid, c.tid), []).append(c)
    for group in by_thread.values():
        group.sort(key=lambda c: (c.start_us, -c.end_us))
        stack: list[SlowCall] = []
        for c in group:
            while stack and stack[-1].end_us + tolerance_us < c.start_us:
                stack.pop()
            stack = [o for o in stack if c.end_us <= o.end_us + tolerance_us]
            for outer in stack:
                outer.inner_us = max(outer.inner_us, c.excess_us)
            stack.append(c)
    return [c for c in calls if c.inner_us < 0.5 * c.excess_us]


def host_cover(ops: OpCalls):
    """Per process: a function ``(lo, hi) -> us of [lo, hi] inside its operator calls`` (union)."""
    from traces.intervals import merge

    out = {}
    for pid, (starts, ends) in ops.cover.items():
        s, e = merge(np.frombuffer(starts, dtype=np.float64), np.frombuffer(ends, dtype=np.float64))
        out[pid] = Coverage(s, e)
    return out


class Coverage:
    """Length of ``[lo, hi]`` covered by sorted disjoint intervals, in O(log n) per query."""

    def __init__(self, starts: np.ndarray, ends: np.ndarray):
        self.s, self.e = starts, ends
        self.cum = np.concatenate(([0.0], np.cumsum(ends - starts)))

    def upto(self, t: float) -> float:
        i = int(np.searchsorted(self.s, t, "right"))
        if i == 0:
            return 0.0
        return float(self.cum[i - 1] + min(max(t - self.s[i - 1], 0.0), self.e[i - 1] - self.s[i - 1]))

    def between(self, lo: float, hi: float) -> float:
        return max(0.0, self.upto(hi) - self.upto(lo)) if hi > lo else 0.0


def _stage_of(call: SlowCall, instances: list) -> object | None:
    """The innermost stage instance of the call's process whose CPU range holds it."""
    around = [i for i in instances if i.pid == call.pid and i.start_us <= call.start_us + 0.01
              and call.end_us <= i.end_us + 0.01]
    return max(around, key=lambda i: (i.depth, i.start_us)) if around else None


def slow_operators(files: list[tuple]) -> list[SlowOperator]:
    """The slow calls of every file (``(slow calls, stage instances, operator calls)`` per file), merged per
    (operator, innermost stage), largest excess first."""
    groups: dict[tuple, list[SlowCall]] = {}
    for slow, instances, _ in files:
        for call in slow:
            inst = _stage_of(call, instances)
            groups.setdefault((call.name, inst.name if inst else None), []).append(call)
    out = []
    for (name, stage), calls in groups.items():
        hist: dict[int, int] = {}
        for _, _, ops in files:
            for b, n in ops.hist(name).items():
                hist[b] = hist.get(b, 0) + n
        n = len(calls)
        by_rule = {r: sum(c.excess_us for c in calls if c.rule == r) for r in ("median", "gpu")}
        out.append(SlowOperator(
            name, stage, sum(hist.values()), n, sum(c.host_us for c in calls) / n / 1e3, lower_median(hist) / 1e3,
            sum(c.gpu_us for c in calls) / n / 1e3, sum(c.launches for c in calls) / n,
            sum(c.excess_us for c in calls) / 1e3, max(by_rule, key=lambda r: (by_rule[r], r))))
    return sorted(out, key=lambda o: (-o.excess_ms, o.name))

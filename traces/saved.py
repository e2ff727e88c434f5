"""Saved report rows back into :class:`traces.records.StageRow` (the ``stages`` entries of a JSON report, schema 1
to 4), every figure checked: a bad one is a ``ValueError`` naming it (``--diff`` against a saved report)."""

from __future__ import annotations

import math

from traces.names import printable
from traces.records import GpuFigures, StageRow, Stats, StepSpread
from traces.work import WorkFigures


#: Figures of a saved row that are never negative (``self_ms`` may be, by rounding: finite only).
_NON_NEGATIVE = ("count", "cpu_ms", "gpu_ms", "gpu_span_ms", "share", "peak_allocated_mib", "peak_reserved_mib",
                 "gpu_share", "launches", "sync_ms", "wait_ms", "comm_ms", "comm_overlap", "per_step", "idle_ms",
                 "host_op_ms")


def _check_figures(d: dict) -> None:
    """``ValueError`` naming the first figure of a saved row that is not a finite number (>= 0 where it must be)."""
    for key in _NON_NEGATIVE + ("self_ms",):
        value = d.get(key)
        items = value.items() if isinstance(value, dict) and key in ("cpu_ms", "gpu_ms", "per_step") else \
            [(None, value)]
        for sub, v in items:
            if v is None:
                continue
            low = 0.0 if key in _NON_NEGATIVE else -math.inf
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < low:
                what = "a finite number >= 0" if low == 0.0 else "a finite number"
                raise ValueError(f"{key}{'.' + str(sub) if sub else ''}: {v!r} is not {what}")


def row_from_dict(d: dict) -> StageRow:
    """A :class:`StageRow` from its JSON form (a ``stages`` entry of a saved report, schema 1 to 4; names made
    printable as :mod:`traces.names` does for traces)."""
    try:
        _check_figures(d)
        gpu, spread = d.get("gpu_ms"), d.get("per_step")
        figures = GpuFigures(d.get("gpu_share"), d.get("launches"), d.get("sync_ms"), d.get("wait_ms"),
                             d.get("bound"), d.get("comm_ms"), d.get("comm_overlap"), d.get("idle_ms"),
                             d.get("host_op_ms"))
        parent = d.get("parent")
        return StageRow(name=printable(str(d["name"])), count=int(d["count"]), cpu_ms=Stats(**d["cpu_ms"]),
                        gpu_ms=Stats(**gpu) if gpu else None, gpu_span_ms=d.get("gpu_span_ms"),
                        self_ms=d.get("self_ms"), share=d.get("share"),
                        peak_allocated_mib=d.get("peak_allocated_mib"),
                        peak_reserved_mib=d.get("peak_reserved_mib"), gpu=figures,
                        parent=None if parent is None else printable(str(parent)), per_step=StepSpread(**spread) if spread else None,
                        work=_work_from_dict(d.get("work")))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"stage entry {d.get('name', '?')!r} is not a report row ({exc})") from None


def _work_from_dict(d) -> WorkFigures | None:
    """The ``work`` object of a schema-4 row (None when absent)."""
    if d is None:
        return None
    for key in ("flops", "bytes", "roofline_ms", "x_roofline"):
        v = d.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0):
            raise ValueError(f"work.{key}: {v!r} is not a finite number >= 0")
    if d.get("limit") not in (None, "memory", "compute"):
        raise ValueError(f"work.limit: {d.get('limit')!r} is not 'memory' or 'compute'")
    return WorkFigures(d["flops"], d["bytes"], d.get("roofline_ms"), d.get("x_roofline"), d.get("limit"))

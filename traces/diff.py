"""Before/after comparison of two reports' per-stage CPU and GPU totals."""

from __future__ import annotations

from traces.rows import StageRow, Stats
from traces.table import Column, fixed, percent, render


def _change(before: float | None, after: float | None) -> dict:
    change = after - before if before is not None and after is not None else None
    relative = change / before if change is not None and before else None
    return {"before": before, "after": after, "change": change, "relative": relative}


def diff_rows(before: list[StageRow], after: list[StageRow]) -> list[dict]:
    """Per stage (union of both sides, in ``after`` order then ``before``-only names): the totals
    before and after, their difference (after - before) and relative change (difference / before;
    None when before is 0 or missing). A side without the stage has None."""
    b = {r.name: r for r in before}
    a = {r.name: r for r in after}
    names = [r.name for r in after] + [r.name for r in before if r.name not in a]
    out = []
    for name in names:
        rb, ra = b.get(name), a.get(name)
        gpu_b = rb.gpu_ms.total if rb and rb.gpu_ms else None
        gpu_a = ra.gpu_ms.total if ra and ra.gpu_ms else None
        out.append({
            "name": name,
            "cpu_total_ms": _change(rb.cpu_ms.total if rb else None, ra.cpu_ms.total if ra else None),
            "gpu_total_ms": _change(gpu_b, gpu_a) if gpu_b is not None or gpu_a is not None else None,
        })
    return out


def row_from_dict(d: dict) -> StageRow:
    """A :class:`StageRow` from its JSON form (a ``stages`` entry of a saved report)."""
    try:
        gpu = d.get("gpu_ms")
        return StageRow(name=str(d["name"]), count=int(d["count"]), cpu_ms=Stats(**d["cpu_ms"]),
                        gpu_ms=Stats(**gpu) if gpu else None, gpu_span_ms=d.get("gpu_span_ms"),
                        self_ms=d.get("self_ms"), share=d.get("share"),
                        peak_allocated_mib=d.get("peak_allocated_mib"),
                        peak_reserved_mib=d.get("peak_reserved_mib"))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"stage entry {d.get('name', '?')!r} is not a report row ({exc})") from None


def format_diff(diff: list[dict], fmt: str = "table") -> str:
    """The diff as a table (ms and %) in ``fmt`` (see :func:`traces.table.render`)."""
    ms, rel = fixed(3), percent(1, signed=True)
    columns = [Column("name", "stage", left=True)]
    for side in ("cpu", "gpu"):
        columns += [Column(f"{side}_before_ms", f"{side} before", ms),
                    Column(f"{side}_after_ms", f"{side} after", ms),
                    Column(f"{side}_change_ms", f"{side} change", ms),
                    Column(f"{side}_relative", f"{side} rel", rel)]
    rows = []
    for d in diff:
        row = [d["name"]]
        for key in ("cpu_total_ms", "gpu_total_ms"):
            c = d[key] or {}
            row += [c.get("before"), c.get("after"), c.get("change"), c.get("relative")]
        rows.append(row)
    return render(columns, rows, fmt)

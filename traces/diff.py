"""Before/after comparison of two reports' per-stage CPU and GPU totals."""

from __future__ import annotations

from traces.rows import StageRow, Stats


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


def format_diff(diff: list[dict]) -> str:
    """The diff as an aligned text table (ms and %)."""
    def cell(v, pct=False):
        if v is None:
            return "-"
        return f"{100 * v:+.1f}%" if pct else f"{v:.3f}"
    head = ["stage", "cpu before", "cpu after", "cpu change", "cpu rel", "gpu before", "gpu after",
            "gpu change", "gpu rel"]
    rows = []
    for d in diff:
        c, g = d["cpu_total_ms"], d["gpu_total_ms"] or {}
        rows.append([d["name"], cell(c["before"]), cell(c["after"]), cell(c["change"]),
                     cell(c["relative"], True), cell(g.get("before")), cell(g.get("after")),
                     cell(g.get("change")), cell(g.get("relative"), True)])
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    line = lambda r: "  ".join(x.ljust(w) if i == 0 else x.rjust(w)
                               for i, (x, w) in enumerate(zip(r, widths)))
    return "\n".join([line(head), "  ".join("-" * w for w in widths)] + [line(r) for r in rows]) + "\n"

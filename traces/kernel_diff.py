"""``--diff`` with ``--kernels N``: per stage, the N kernels (and copies) whose summed GPU time changed most.

Both sides' kernel lists are complete (every name a stage ran, :attr:`traces.report.Report.stage_kernels`), so a
name missing on one side ran 0 ms there: a kernel that one side replaced by another shows as one gone and one new.
The baseline must be traces: a saved JSON report keeps only each stage's top kernels. The changes go into each
stage's diff entry (``"kernels"``), so the JSON report carries them; the text forms print one table.
"""

from __future__ import annotations

from traces.format import short_kernel_names
from traces.names import shown
from traces.records import KernelRow
from instrumentation.table import Column, fixed, percent, render

#: Widest kernel name the text table prints (shortened by :func:`traces.format.short_kernel_names`).
NAME_WIDTH = 60
#: Changes smaller than this (ms over the traces) are not listed: a stage whose kernels ran alike lists none.
MIN_CHANGE_MS = 1e-3

_MS = fixed(3)
COLUMNS = [Column("stage", "stage", left=True), Column("kernel", "kernel", left=True),
           Column("calls_before", "calls b"), Column("calls_after", "calls a"), Column("before_ms", "before ms", _MS),
           Column("after_ms", "after ms", _MS), Column("change_ms", "Δ ms", fixed(3, signed=True)),
           Column("relative", "Δ %", percent(1, signed=True))]


def kernel_changes(before: tuple[KernelRow, ...], after: tuple[KernelRow, ...], n: int) -> list[dict]:
    """The ``n`` names of either side with the largest |after - before| summed GPU ms (ties by name; at least
    :data:`MIN_CHANGE_MS`): calls and ms of each side (0 where a side did not run it), the change and the change over
    before (None from 0)."""
    b, a = {k.name: k for k in before}, {k.name: k for k in after}

    def ms(side: dict, name: str) -> float:
        return side[name].gpu_ms if name in side else 0.0

    changed = [name for name in set(a) | set(b) if abs(ms(a, name) - ms(b, name)) >= MIN_CHANGE_MS]
    ranked = sorted(changed, key=lambda name: (-abs(ms(a, name) - ms(b, name)), name))[:n]
    out = []
    for name in ranked:
        change = ms(a, name) - ms(b, name)
        out.append({"kernel": name, "calls_before": b[name].count if name in b else 0,
                    "calls_after": a[name].count if name in a else 0, "before_ms": ms(b, name),
                    "after_ms": ms(a, name), "change_ms": change,
                    "relative": change / ms(b, name) if ms(b, name) else None})
    return out


def attach(diff: list[dict], before: dict[str, tuple[KernelRow, ...]], after: dict[str, tuple[KernelRow, ...]],
           n: int) -> None:
    """Set ``"kernels"`` (:func:`kernel_changes`) on each diff entry of a stage of both sides whose kernels changed."""
    for d in diff:
        name = d["name"]
        changes = kernel_changes(before[name], after[name], n) if name in before and name in after else []
        if changes:
            d["kernels"] = changes


def format_kernel_changes(diff: list[dict], fmt: str = "table") -> str | None:
    """One table of every stage's kernel changes (None when no entry has any)."""
    entries = [(d["name"], k) for d in diff for k in d.get("kernels", ())]
    if not entries:
        return None
    names = short_kernel_names([k["kernel"] for _, k in entries], NAME_WIDTH) if fmt == "table" else \
        [k["kernel"] for _, k in entries]
    rows, last = [], None
    for (stage, k), name in zip(entries, names):
        rows.append([shown(stage) if stage != last or fmt != "table" else "", name, k["calls_before"],
                     k["calls_after"], k["before_ms"], k["after_ms"], k["change_ms"], k["relative"]])
        last = stage
    return render(COLUMNS, rows, fmt)

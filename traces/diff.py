"""Before/after comparison of two reports: per-call and per-step means with counts and a noise guard.

Per stage and side: ``count`` (ranges), ``steps`` (recorded (rank, step) pairs), per-call means
(CPU / GPU total over count) and per-step means (the stage's total per (rank, step) pair, averaged
over the pairs; a pair where it did not run counts as 0). Per-step figures compare runs that recorded
different numbers of steps or ranks. The noise guard of a per-step change is
``noise = 2 * sqrt(sd_before**2 / n_before + sd_after**2 / n_after)`` (about a 95% interval of the
difference of the means, from the spread across recorded steps); a change is ``significant`` when
its size exceeds the noise, None when a side has fewer than two steps (no spread). A baseline of
schema version 1 has no spread: its per-step means come from totals over its ``opsd/step`` count.
"""

from __future__ import annotations

import math

from traces.records import StageRow
from traces.saved import row_from_dict  # noqa: F401  (part of this API)
from traces.report import SCHEMA_VERSION
from instrumentation.table import Column, fixed, percent, render

STEP_NAME = "opsd/step"
#: Schema versions of a saved report that ``--diff`` reads.
READ_SCHEMAS = tuple(range(1, SCHEMA_VERSION + 1))


def baseline_problem(doc) -> str | None:
    """Why a saved JSON report cannot be a ``--diff`` baseline (the end of a line that names its file), or None."""
    if not isinstance(doc, dict):
        return "is not a JSON object"
    if "runs" in doc and "stages" not in doc:
        runs = doc["runs"]
        return (f"is a report of {len(runs) if isinstance(runs, list) else 'several'} runs; save one run's report "
                "(summarise its run directory) as the baseline")
    version = doc.get("schema_version")
    if type(version) is not int or version not in READ_SCHEMAS:
        return f"has schema_version {version!r}; this opsd-summarize reads {', '.join(map(str, READ_SCHEMAS))}"
    stages = doc.get("stages")
    if not isinstance(stages, list):
        return "holds no stages (" + ("no 'stages' list" if stages is None else "'stages' is not a list") + ")"
    if not stages:
        return "holds no stages (an empty 'stages' list)"
    for k, stage in enumerate(stages):
        if not isinstance(stage, dict):
            return f"has stages[{k}] of type {type(stage).__name__}: stages[{k}] must be an object"
        if not isinstance(stage.get("name"), str):
            return f"has stages[{k}].name {stage.get('name')!r:.40}: stages[{k}].name must be a string"
    return None


def _change(before: float | None, after: float | None) -> dict:
    change = after - before if before is not None and after is not None else None
    relative = change / before if change is not None and before else None
    return {"before": before, "after": after, "change": change, "relative": relative}


def noise_ms(sd_before, n_before, sd_after, n_after) -> float | None:
    """The noise guard of a change of per-step means (see the module docstring)."""
    if sd_before is None or sd_after is None or not n_before or not n_after:
        return None
    return 2.0 * math.sqrt(sd_before ** 2 / n_before + sd_after ** 2 / n_after)


def _side(row: StageRow | None, num_steps: int | None) -> dict:
    """Per-call and per-step figures of one side (all None when the stage is missing)."""
    if row is None:
        return {"count": None, "steps": num_steps, "cpu_call": None, "gpu_call": None,
                "cpu_step": 0.0 if num_steps else None, "gpu_step": None, "cpu_sd": None, "gpu_sd": None}
    gpu_total = row.gpu_ms.total if row.gpu_ms else None
    spread = row.per_step
    if spread is not None:
        steps, cpu_step, gpu_step = spread.n, spread.cpu_mean_ms, spread.gpu_mean_ms
        cpu_sd, gpu_sd = spread.cpu_sd_ms, spread.gpu_sd_ms
    else:
        steps, cpu_sd, gpu_sd = num_steps, None, None
        cpu_step = row.cpu_ms.total / steps if steps else None
        gpu_step = gpu_total / steps if steps and gpu_total is not None else None
    return {"count": row.count, "steps": steps, "cpu_call": row.cpu_ms.mean,
            "gpu_call": row.gpu_ms.mean if row.gpu_ms else None, "cpu_step": cpu_step,
            "gpu_step": gpu_step, "cpu_sd": cpu_sd, "gpu_sd": gpu_sd}


def _step_change(b: dict, a: dict, key: str) -> dict | None:
    if b[f"{key}_step"] is None and a[f"{key}_step"] is None:
        return None
    out = _change(b[f"{key}_step"], a[f"{key}_step"])
    noise = noise_ms(b[f"{key}_sd"], b["steps"], a[f"{key}_sd"], a["steps"])
    out["noise"] = noise
    out["significant"] = (abs(out["change"]) > noise if noise is not None and out["change"] is not None
                          else None)
    return out


def _num_steps(rows: list[StageRow]) -> int | None:
    step = next((r for r in rows if r.name == STEP_NAME), None)
    if step is None:
        return None
    return step.per_step.n if step.per_step is not None else step.count


def diff_rows(before: list[StageRow], after: list[StageRow]) -> list[dict]:
    """Per stage (union of both sides, in ``after`` order then ``before``-only names): counts,
    per-call and per-step means before and after, changes, the noise guard, and the totals."""
    b_rows, a_rows = {r.name: r for r in before}, {r.name: r for r in after}
    b_steps, a_steps = _num_steps(before), _num_steps(after)
    names = [r.name for r in after] + [r.name for r in before if r.name not in a_rows]
    out = []
    for name in names:
        rb, ra = b_rows.get(name), a_rows.get(name)
        b, a = _side(rb, b_steps), _side(ra, a_steps)
        gpu_b = rb.gpu_ms.total if rb and rb.gpu_ms else None
        gpu_a = ra.gpu_ms.total if ra and ra.gpu_ms else None
        out.append({
            "name": name, "count": {"before": b["count"], "after": a["count"]},
            "steps": {"before": b["steps"], "after": a["steps"]},
            "cpu_call_ms": _change(b["cpu_call"], a["cpu_call"]),
            "gpu_call_ms": (_change(b["gpu_call"], a["gpu_call"])
                            if b["gpu_call"] is not None or a["gpu_call"] is not None else None),
            "cpu_step_ms": _step_change(b, a, "cpu"), "gpu_step_ms": _step_change(b, a, "gpu"),
            "cpu_total_ms": _change(rb.cpu_ms.total if rb else None, ra.cpu_ms.total if ra else None),
            "gpu_total_ms": _change(gpu_b, gpu_a) if gpu_b is not None or gpu_a is not None else None,
        })
    return out


def verdict(d: dict) -> str | None:
    """``slower`` / ``faster`` (naming cpu and/or gpu) when a per-step change exceeds the noise,
    ``within noise`` when none does, None when the noise is unknown."""
    words, known = [], False
    for side in ("cpu", "gpu"):
        c = d.get(f"{side}_step_ms")
        if c is None or c["significant"] is None:
            continue
        known = True
        if c["significant"]:
            words.append(f"{side} {'slower' if c['change'] > 0 else 'faster'}")
    return ", ".join(words) if words else ("within noise" if known else None)


_MS, _REL = fixed(3), percent(1, signed=True)


def _get(d: dict, key: str, field: str):
    value = d.get(key)
    return value.get(field) if value else None


def diff_columns() -> list[Column]:
    """The columns of the per-step diff table (also the diff part of a CSV row)."""
    cols = [Column("name", "stage", left=True), Column("steps_before", "steps b"),
            Column("steps_after", "steps a"), Column("count_before", "calls b"),
            Column("count_after", "calls a")]
    for side in ("cpu", "gpu"):
        cols += [Column(f"{side}_step_before_ms", f"{side}/step b", _MS),
                 Column(f"{side}_step_after_ms", f"{side}/step a", _MS),
                 Column(f"{side}_step_relative", f"{side} chg", _REL),
                 Column(f"{side}_step_noise_ms", f"{side} noise", _MS)]
    cols += [Column(f"{side}_call_{when}_ms", f"{side}/call {when[0]}", _MS)
             for side in ("cpu", "gpu") for when in ("before", "after")]
    return cols + [Column("verdict", "verdict", left=True)]


def diff_values(d: dict) -> list:
    """The values of one diff entry in :func:`diff_columns` order."""
    values = [d["name"], d["steps"]["before"], d["steps"]["after"], d["count"]["before"],
              d["count"]["after"]]
    for side in ("cpu", "gpu"):
        key = f"{side}_step_ms"
        values += [_get(d, key, "before"), _get(d, key, "after"), _get(d, key, "relative"),
                   _get(d, key, "noise")]
    values += [_get(d, f"{side}_call_ms", when) for side in ("cpu", "gpu") for when in ("before", "after")]
    return values + [verdict(d)]


#: Widest a compact diff table prints (``--diff-wide``: every column).
COMPACT_WIDTH = 100
_SIGNED_MS = fixed(3, signed=True)


def basis(diff: list[dict]) -> str:
    """``"gpu"`` when the step's GPU time per step is known on both sides, else ``"cpu"``: the figure the compact
    table and the headline compare. Without an ``opsd/step`` range on either side (a traced call, not a training
    step) there are no per-step means: ``"gpu_total"`` (``"cpu_total"`` where no stage has GPU time on both sides)
    compares each stage's totals over the traces, with no noise guard."""
    step = next((d for d in diff if d["name"] == STEP_NAME), None)
    if step is None:
        both = any(d["gpu_total_ms"] and d["gpu_total_ms"]["change"] is not None for d in diff)
        return "gpu_total" if both else "cpu_total"
    change = step.get("gpu_step_ms")
    return "gpu" if change and change["before"] is not None and change["after"] is not None else "cpu"


def _key(side: str) -> str:
    """The diff entry's key of :func:`basis`'s figure."""
    return f"{side}_ms" if side.endswith("_total") else f"{side}_step_ms"


def _steps(diff: list[dict]) -> tuple:
    step = next((d for d in diff if d["name"] == STEP_NAME), None)
    return (step["steps"]["before"], step["steps"]["after"]) if step else (None, None)


def noise_note(diff: list[dict]) -> str:
    """How the ± noise column was computed, with its n."""
    side = basis(diff)
    if side.endswith("_total"):
        return (f"{side[:3].upper()} ms over each side's traces: no {STEP_NAME} ranges, so no per-step means and "
                "no noise guard")
    before, after = _steps(diff)
    n = f"{before if before is not None else '?'} + {after if after is not None else '?'}"
    return f"per-step {side.upper()} ms; ± noise = 2 sd of the difference of the means, n = {n} steps"


def diff_headline(diff: list[dict]) -> str | None:
    """One line for the top of a report or a PR: the step's per-step time before and after, its change, the noise
    with its n, and the verdict; None without an ``opsd/step`` on both sides."""
    step = next((d for d in diff if d["name"] == STEP_NAME), None)
    side = basis(diff)
    change = step.get(_key(side)) if step else None
    if not change or change["before"] is None or change["after"] is None:
        return None
    before, after = _steps(diff)
    relative = "" if change["relative"] is None else f", {100 * change['relative']:+.1f}%"
    if change["noise"] is None:
        noise, call = "noise unknown (fewer than 2 steps a side)", "no verdict"
    else:
        noise = f"± {change['noise']:.3f} ms (n = {before} + {after} steps)"
        call = "within noise" if not change["significant"] else ("slower" if change["change"] > 0 else "faster")
    return (f"step ({side.upper()} ms/step): {change['before']:.3f} -> {change['after']:.3f} "
            f"(Δ {change['change']:+.3f} ms{relative}), {noise}: {call}")


def compact_columns(side: str) -> list[Column]:
    """stage | before | after | Δ ms | Δ % | ± noise | verdict (per-step means of ``side``, or its totals)."""
    k = _key(side)[:-3]
    return [Column("name", "stage", left=True), Column(f"{k}_before_ms", "before", _MS),
            Column(f"{k}_after_ms", "after", _MS), Column(f"{k}_change_ms", "Δ ms", _SIGNED_MS),
            Column(f"{k}_relative", "Δ %", _REL), Column(f"{k}_noise_ms", "± noise", _MS),
            Column("verdict", "verdict", left=True)]


def _short(name: str, width: int | None) -> str:
    return name if width is None or len(name) <= width else name[:width - 1] + "…"


def compact_values(d: dict, side: str, name_width: int | None = None) -> list:
    """The values of one diff entry in :func:`compact_columns` order (the name cut to ``name_width``, if given)."""
    key = _key(side)
    return [_short(d["name"], name_width), _get(d, key, "before"), _get(d, key, "after"), _get(d, key, "change"),
            _get(d, key, "relative"), _get(d, key, "noise"), verdict(d)]


def format_diff(diff: list[dict], fmt: str = "table", wide: bool = False) -> str:
    """The diff in ``fmt``: compact (stage | before | after | Δ ms | Δ % | ± noise | verdict; as text at most
    :data:`COMPACT_WIDTH` columns, long stage names shortened) or, with ``wide``, every figure (per-step means of both
    clocks with their noise, per-call means, counts: also what CSV carries)."""
    if wide:
        return render(diff_columns(), [diff_values(d) for d in diff], fmt)
    side = basis(diff)
    columns = compact_columns(side)
    text = render(columns, [compact_values(d, side) for d in diff], fmt)
    width = max((len(d["name"]) for d in diff), default=0)
    while fmt == "table" and max(map(len, text.splitlines())) > COMPACT_WIDTH and width > 12:
        width -= 2
        text = render(columns, [compact_values(d, side, width) for d in diff], fmt)
    return text

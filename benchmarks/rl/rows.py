"""The RL suite's rows: one dataclass per (cell, candidate), the columns derived across a cell, the table, and the
merge of several result files (shards, or runs of different commits)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

from benchmarks.harness import results
from benchmarks.harness.table import fmt, markdown_table
from benchmarks.rl.cells import CELLS


@dataclass
class RlRow:
    """One (cell, candidate) result; every column of the table. None: not measured / not applicable."""

    source: str
    cell: str
    candidate: str
    status: str = "ok"
    note: str = ""
    prompts: int = 0
    n: int = 0
    rows: int = 0
    prompt_lens: str = ""
    budget: int = 0
    sampling: str = ""
    slots: Optional[int] = None
    repeats: int = 0
    seeds: int = 1
    """Sampling seeds the timed rounds cycled through (``--seeds``)."""
    response_tokens: Optional[float] = None
    tok_s: Optional[float] = None
    wall_ms: Optional[float] = None
    wall_ms_min: Optional[float] = None
    wall_ms_max: Optional[float] = None
    walls_ms: list = field(default_factory=list)
    """Each timed call's wall ms, in round order."""
    roofline_ms: Optional[float] = None
    prefill_roofline_ms: Optional[float] = None
    x_roofline: Optional[float] = None
    roofline_prompt_once_ms: Optional[float] = None
    """The roofline with each prompt's keys and values read once a decode step for its live samples (``prompt_once``
    of ``instrumentation.roofline.call_roofline_s``): what a step reading each prompt once must read."""
    x_roofline_prompt_once: Optional[float] = None
    gpu_busy_pct: Optional[float] = None
    gpu_busy_note: str = ""
    peak_gib: Optional[float] = None
    route: Optional[str] = None
    """``CallStats.route`` of the last timed call (``"deepspeed-no-cb"`` for DeepSpeed)."""
    len_mean: Optional[float] = None
    len_p50: Optional[int] = None
    len_p90: Optional[int] = None
    len_max: Optional[int] = None
    auto_choice: Optional[str] = None
    auto_vs_best: Optional[float] = None
    best_candidate: Optional[str] = None
    auto_vs_best_roofline: Optional[float] = None
    """Auto's roofline ratio over the lowest of the routes' (each from its own realised lengths): sampled tokens
    differ between batch shapes in bf16, so one route may draw a longer row than another, which wall time counts
    against it and the ratio does not."""
    best_roofline_candidate: Optional[str] = None
    vs_deepspeed: Optional[float] = None
    same_tokens: Optional[bool] = None
    after_profile: Optional[bool] = None
    """The timed calls ran after a profiled call of this process (CUPTI callbacks may linger: pass
    ``--cupti-teardown``, or ``--busy off`` for untouched timings)."""
    eos_scale: Optional[float] = None
    norm_factor: Optional[float] = None
    nucleus_median: Optional[float] = None
    stats: dict = field(default_factory=dict)
    """``Rollout.last_stats.flat()`` of the last timed call but ``route`` (scalars, by dotted name:
    ``decode.path``, ``prefill.path``, ``cache.num_slots``, ...)."""


def derive(rows: list[RlRow]) -> None:
    """Fill Auto / best (by wall time and by roofline ratio), the best candidates and vs DeepSpeed within each
    (source, cell)."""
    groups: dict[tuple, list[RlRow]] = {}
    for r in rows:
        groups.setdefault((r.source, r.cell), []).append(r)
    for group in groups.values():
        timed = [r for r in group if r.status == "ok" and r.wall_ms is not None]
        routes = [r for r in timed if r.candidate == "ordinary" or r.candidate.startswith("continuous")]
        best = min(routes, key=lambda r: r.wall_ms, default=None)
        ratios = [r for r in routes if r.x_roofline is not None]
        best_ratio = min(ratios, key=lambda r: r.x_roofline, default=None)
        upstream = next((r for r in timed if r.candidate == "deepspeed"), None)
        for r in group:
            r.vs_deepspeed = (r.wall_ms / upstream.wall_ms if upstream is not None and r is not upstream
                              and r.wall_ms is not None else None)
            if r.candidate == "auto":
                r.best_candidate = best.candidate if best is not None else None
                r.auto_vs_best = (r.wall_ms / best.wall_ms if best is not None and r.wall_ms is not None else None)
                r.best_roofline_candidate = best_ratio.candidate if best_ratio is not None else None
                r.auto_vs_best_roofline = (r.x_roofline / best_ratio.x_roofline
                                           if best_ratio is not None and r.x_roofline is not None else None)


HEADER = ("source", "cell", "candidate", "tok/s", "wall ms (min-max)", "roofline ms", "x roof", "GPU busy", "peak GiB",
          "route / decode / prefill", "lengths mean/p50/p90/max", "Auto's choice", "Auto/best", "vs DS", "same tok",
          "note")


def table_cells(r: RlRow) -> list:
    """The row's cells under :data:`HEADER`."""
    if r.status != "ok":
        return [r.source, r.cell, r.candidate] + [None] * 12 + ["; ".join(t for t in (r.status, r.note) if t)]
    busy = fmt(r.gpu_busy_pct, ".0f") + "%" if r.gpu_busy_pct is not None else (r.gpu_busy_note or "n/a")
    wall = f"{fmt(r.wall_ms, '.0f')} ({fmt(r.wall_ms_min, '.0f')}-{fmt(r.wall_ms_max, '.0f')})"
    lengths = f"{fmt(r.len_mean, '.1f')}/{fmt(r.len_p50)}/{fmt(r.len_p90)}/{fmt(r.len_max)}"
    path = f"{fmt(r.route)} / {fmt(r.stats.get('decode.path'))} / {fmt(r.stats.get('prefill.path'))}"
    auto_best = f"{r.auto_vs_best:.3f} (best {r.best_candidate})" if r.auto_vs_best is not None else ""
    if r.auto_vs_best_roofline is not None:
        auto_best += f"; by x roof {r.auto_vs_best_roofline:.3f} (best {r.best_roofline_candidate})"
    return [r.source, r.cell, r.candidate, fmt(r.tok_s, ".0f"), wall, fmt(r.roofline_ms, ".0f"),
            fmt(r.x_roofline, ".2f"), busy, fmt(r.peak_gib, ".1f"), path, lengths, r.auto_choice or "", auto_best,
            fmt(r.vs_deepspeed, ".3f"), r.same_tokens, r.note]


def format_table(rows: list[RlRow]) -> str:
    return markdown_table(HEADER, [table_cells(r) for r in rows])


def sort_rows(rows: list[RlRow]) -> list[RlRow]:
    """By cell, then candidate (auto, ordinary, continuous by falling slots, the rest, deepspeed); rows of one
    (cell, candidate) keep their order, so several sources (files) sit side by side."""
    cells = [c.name for c in CELLS]

    def order(r: RlRow):
        cell = cells.index(r.cell) if r.cell in cells else len(cells)
        name = r.candidate
        tail = name.rsplit("-", 1)[-1]
        is_slots = name.startswith("continuous-") and tail.isdigit()
        rank = {"auto": 0, "ordinary": 1, "deepspeed": 4}.get(name, 2 if is_slots else 3)
        return cell, rank, -int(tail) if is_slots else 0, name

    return sorted(rows, key=order)


def load_rows(paths: list[str]) -> list[RlRow]:
    """Rows of several result files (this schema or older; old ``CallStats`` names mapped to today's), derived
    columns recomputed."""
    rows = []
    for path in paths:
        doc = results.read(path)
        source = doc.meta.get("commit_label") or doc.meta.get("commit") or os.path.basename(path)
        rows += results.rows_of(RlRow, doc, source=source)
    derive(rows)
    return sort_rows(rows)

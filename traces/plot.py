"""``--plot out.png``: per-stage CPU and GPU time, side by side, in the stage's own colour.

Left panel: one row per stage (the stage tree, top to bottom), a solid bar for CPU ms and a hatched
bar for GPU ms, each labelled with its value; the figures are per recorded step (mean over (rank,
step) pairs) when the trace has step ranges, else totals. With several ranks, a whisker on each bar
spans the per-rank minimum to maximum (the value label sits at the whisker's end). With ``--diff``, each bar has a pale twin above it: the
baseline. Right panel (several ranks, or ``--by-step``): a heat map of CPU ms per stage and rank (or
step), each cell labelled and shaded from the stage's smallest (white) to its largest value (dark), so
the straggler of each stage stands out. The title carries the headline: the root stage's ms per step, GPU busy,
and the x roofline of the stages with work records (:func:`roofline_line`); stages under :data:`FOLD_SHARE` of
the step are folded into one grey bar, "other". Colours come from
``instrumentation.stages.STAGE_COLORS`` (one per stage, as in Nsight Systems); other names get
colours of matplotlib's ``tab20``.
"""

from __future__ import annotations

import os

from traces.report import Report
from traces.records import StageRow
from traces.tensorboard import OutputError

_BAR = 0.36


def stage_colors(names: list[str]) -> dict[str, str]:
    """A distinct colour per name: the contract's stage colours, then ``tab20`` for other names."""
    from matplotlib import colormaps

    from instrumentation import stages as S

    out, extra = {}, colormaps["tab20"]
    for name in names:
        stage = S.stage_of(name)
        if stage is not None:
            out[name] = f"#{S.STAGE_COLORS[stage] & 0xFFFFFF:06x}"
    others = [n for n in names if n not in out]
    for i, name in enumerate(others):
        out[name] = extra(i % 20)
    return out


def per_step(row: StageRow, steps: int | None) -> tuple[float, float | None]:
    """(CPU ms, GPU ms) of a row per recorded step (its totals when there are no steps)."""
    if row.per_step is not None:
        return row.per_step.cpu_mean_ms, row.per_step.gpu_mean_ms
    gpu = row.gpu_ms.total if row.gpu_ms else None
    if steps:
        return row.cpu_ms.total / steps, None if gpu is None else gpu / steps
    return row.cpu_ms.total, gpu


def _num_steps(rows: list[StageRow]) -> int | None:
    step = next((r for r in rows if r.name == "opsd/step"), None)
    return None if step is None else step.count


def _rank_range(report: Report, name: str) -> tuple[list[float], list[float]]:
    """Per-rank CPU and GPU per-step values of a stage."""
    cpu, gpu = [], []
    for rows in report.per_rank.values():
        row = next((r for r in rows if r.name == name), None)
        if row is not None:
            c, g = per_step(row, _num_steps(rows))
            cpu.append(c)
            if g is not None:
                gpu.append(g)
    return cpu, gpu


def _number(value: float) -> str:
    """Three significant digits, trailing zeros kept (``1.00``, ``0.273``, ``168``)."""
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:#.3g}"


def _bar(ax, y: float, value: float | None, color, hatch=None, alpha=1.0, spread=None) -> None:
    if value is None:
        return
    err, end = None, value
    if spread:
        err = [[max(0.0, value - min(spread))], [max(0.0, max(spread) - value)]]
        end = max(value, max(spread))
    ax.barh(y, value, height=_BAR, color=color, alpha=alpha, hatch=hatch, edgecolor="black",
            linewidth=0.4, xerr=err, error_kw={"elinewidth": 0.8, "capsize": 2})
    ax.annotate(_number(value), (end, y), xytext=(3, 0), textcoords="offset points",
                va="center", fontsize=7)


def _tree_labels(ax, ticks: list[float], labels: list[str], fontsize: int = 8) -> None:
    """Stage names (already indented by their depth in the stage tree), left-aligned."""
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels, fontsize=fontsize, ha="left", family="monospace")
    ax.tick_params(axis="y", pad=0.62 * fontsize * max((len(x) for x in labels), default=1))


#: Stages whose CPU and GPU time per step both stay under this share of the root stage's are folded into one bar.
FOLD_SHARE = 0.01
_FOLDED_COLOR = "#b0b0b0"


def fold(rows: list[StageRow], steps: int | None) -> tuple[list[StageRow], list[StageRow]]:
    """``(shown, folded)``: the rows worth a bar, and the small ones (see :data:`FOLD_SHARE`; roots are always shown)."""
    roots = [per_step(r, steps)[0] for r in rows if r.parent is None]
    limit = FOLD_SHARE * max(roots, default=0.0)
    shown, folded = [], []
    for row in rows:
        cpu, gpu = per_step(row, steps)
        small = row.parent is not None and cpu < limit and (gpu or 0.0) < limit
        (folded if small else shown).append(row)
    return shown, folded


def roofline_line(rows: list[StageRow]) -> str | None:
    """The stages' x roofline (GPU ms over roofline ms, from the run's work records), largest first, and that
    of their sum; None when no stage has one."""
    with_x = sorted((r for r in rows if r.work is not None and r.work.x_roofline is not None),
                    key=lambda r: -r.work.x_roofline)
    if not with_x:
        return None
    total = sum(r.work.x_roofline * r.work.roofline_ms for r in with_x) / sum(r.work.roofline_ms for r in with_x)
    parts = ", ".join(f"{r.name.rsplit('/', 1)[-1]} {r.work.x_roofline:.1f}" for r in with_x)
    return f"x roofline {total:.1f} over {len(with_x)} stages ({parts})"


def _title(report: Report, several: bool) -> str:
    head, title = report.headline, "per-stage CPU and GPU time"
    if head is not None and head.num_ranges:
        title = f"{head.stage}: {_number(head.wall_ms / head.num_ranges)} ms per range"
        if head.stage.endswith("/step"):
            title = title.replace("per range", "per step")
        if head.gpu_busy_pct is not None:
            title += f", GPU busy {head.gpu_busy_pct:.1f}%"
    title += " (whiskers: min-max over ranks)" if several else ""
    rooflines = roofline_line(report.stages)
    return title if rooflines is None else title + "\n" + rooflines


def folded_label(folded: list[StageRow]) -> str:
    """The label of the one bar of the folded stages."""
    return f"other: {len(folded)} stages < {FOLD_SHARE:.0%} each"


def _bars(ax, report: Report, before: list[StageRow] | None) -> None:
    from matplotlib.patches import Patch

    steps, base = _num_steps(report.stages), {r.name: r for r in before or ()}
    rows, folded = fold(report.stages, steps)
    colors = stage_colors([r.name for r in report.stages])
    base_steps = _num_steps(before or [])
    several = len(report.per_rank) > 1
    for i, row in enumerate(rows):
        y, (cpu, gpu) = 2 * i, per_step(row, steps)
        c_spread, g_spread = _rank_range(report, row.name) if several else (None, None)
        _bar(ax, y - _BAR / 2, cpu, colors[row.name], spread=c_spread)
        _bar(ax, y + _BAR / 2, gpu, colors[row.name], hatch="///", alpha=0.55, spread=g_spread)
        if row.name in base:
            b_cpu, b_gpu = per_step(base[row.name], base_steps)
            _bar(ax, y - 1.5 * _BAR, b_cpu, colors[row.name], alpha=0.25)
            _bar(ax, y + 1.5 * _BAR, b_gpu, colors[row.name], hatch="///", alpha=0.15)
    labels = [("   " * r.depth + r.name) for r in rows]
    if folded:  # one bar for the small stages (their own times summed; nested ones may overlap)
        y = 2 * len(rows)
        values = [per_step(r, steps) for r in folded]
        _bar(ax, y - _BAR / 2, sum(c for c, _ in values), _FOLDED_COLOR)
        gpus = [g for _, g in values if g is not None]
        _bar(ax, y + _BAR / 2, sum(gpus) if gpus else None, _FOLDED_COLOR, hatch="///", alpha=0.55)
        labels.append(folded_label(folded))
    _tree_labels(ax, [2 * i for i in range(len(labels))], labels)
    ax.invert_yaxis()
    unit = "ms per step" if steps or any(r.per_step for r in report.stages) else "ms (total)"
    ax.set_xlabel(unit)
    handles = [Patch(facecolor="#808080", edgecolor="black", label="CPU"),
               Patch(facecolor="#808080", alpha=0.55, hatch="///", edgecolor="black", label="GPU")]
    if before:
        handles.append(Patch(facecolor="#808080", alpha=0.25, edgecolor="black", label="before (--diff)"))
    ax.legend(handles=handles, loc="lower right", fontsize=8)
    ax.set_title(_title(report, several))
    ax.grid(axis="x", alpha=0.3)


def _heatmap(ax, report: Report, by_step: bool) -> None:
    groups = report.per_step if by_step else report.per_rank
    keys, names = sorted(groups), [r.name for r in report.stages]
    grid = [[next((r.cpu_ms.total for r in groups[k] if r.name == n), 0.0) for k in keys] for n in names]
    relative = [[(v - min(row)) / (max(row) - min(row)) if max(row) > min(row) else 0.0 for v in row]
                for row in grid]
    image = ax.imshow(relative, aspect="auto", cmap="Blues", vmin=0.0, vmax=1.0)
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            ax.text(j, i, _number(value), ha="center", va="center", fontsize=6,
                    color="white" if relative[i][j] > 0.6 else "black")
    ax.set_xticks(range(len(keys)))
    ax.set_xticklabels([str(k) for k in keys], fontsize=8)
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(names, fontsize=7)
    ax.set_xlabel("step" if by_step else "rank")
    ax.set_title("CPU ms per stage and " + ("step" if by_step else "rank") + " (shade: stage's min to max)",
                 fontsize=10)
    ax.figure.colorbar(image, ax=ax, fraction=0.04)


def path_flag_problem(args) -> str | None:
    """Why a path flag of ``summarize_trace.py`` cannot be used (an empty path; a --tensorboard that is not a directory), or None."""
    for flag in ("--diff", "--plot", "--tensorboard"):
        if getattr(args, flag[2:]) == "":
            return f"{flag}: empty path"
    board = args.tensorboard
    if board:
        above = os.path.abspath(board)
        while not os.path.exists(above) and os.path.dirname(above) != above:
            above = os.path.dirname(above)
        if not os.path.isdir(above):
            return f"--tensorboard {board}: {above} is not a directory (give a directory for the TensorBoard runs)"
    return None


def plot_problem(path: str) -> str | None:
    """Why ``--plot path`` cannot be written (checked before any trace is read), or None: matplotlib missing, a
    format matplotlib does not write (``x.html``), or a folder that does not exist."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        from matplotlib.figure import Figure
    except ImportError:
        return "--plot needs matplotlib (pip install matplotlib)"
    suffix = os.path.splitext(path)[1].lstrip(".").lower()
    formats = Figure().canvas.get_supported_filetypes()
    if suffix not in formats:
        return f"--plot {path}: {suffix or 'no'} suffix; matplotlib writes {', '.join(sorted(formats))} (e.g. x.png)"
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"--plot {path}: folder {folder} does not exist"
    return None


def plot_report(report: Report, path: str, by_step: bool = False,
                before: list[StageRow] | None = None) -> None:
    """Write the PNG (see the module docstring); :class:`OutputError` when it cannot."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise OutputError("--plot needs matplotlib (pip install matplotlib)") from None
    heat = by_step and len(report.per_step) > 1 or len(report.per_rank) > 1
    rows = len(fold(report.stages, _num_steps(report.stages))[0]) + 1  # the shown stages and the folded bar
    fig, axes = plt.subplots(1, 2 if heat else 1, figsize=(17 if heat else 10, max(4.0, 0.42 * rows * (2 if before else 1.3) + 1.5)),
                             gridspec_kw={"width_ratios": [3, 2]} if heat else None, squeeze=False)
    _bars(axes[0][0], report, before)
    if heat:
        _heatmap(axes[0][1], report, by_step)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise OutputError(f"{path}: cannot write ({exc})") from None
    finally:
        plt.close(fig)


__all__ = ["OutputError", "plot_problem", "plot_report", "stage_colors"]

"""Optional outputs: a PNG of the per-stage breakdown and TensorBoard scalars."""

from __future__ import annotations

from traces.report import STEP_NAME, Report
from traces.rows import StageRow


class OutputError(Exception):
    """An optional output that cannot be produced (missing library, unwritable path)."""


def _self_times(groups: dict[int, list[StageRow]]) -> tuple[list[int], dict[str, list[float]]]:
    keys = sorted(groups)
    names = []
    for rows in groups.values():
        names += [r.name for r in rows if r.name not in names]
    series = {n: [next((r.self_ms or 0.0 for r in groups[k] if r.name == n), 0.0) for k in keys]
              for n in names}
    return keys, series


def plot_breakdown(report: Report, path: str, by_step: bool = False) -> None:
    """Stacked bars of per-stage self time (ms), one bar per rank (per step with ``by_step``).

    Self times do not double-count nesting, so a bar's height is the CPU time covered by stages.
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise OutputError("--plot needs matplotlib (pip install matplotlib)") from None
    groups = report.per_step if by_step else report.per_rank
    keys, series = _self_times(groups)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.5 * len(keys) + 4), 5))
    bottom = [0.0] * len(keys)
    for name, values in series.items():
        ax.bar([str(k) for k in keys], values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xlabel("step" if by_step else "rank")
    ax.set_ylabel("self time (ms)")
    ax.set_title("per-stage self time")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100)
    except OSError as exc:
        raise OutputError(f"{path}: cannot write ({exc})") from None
    finally:
        plt.close(fig)


def write_tensorboard(report: Report, logdir: str) -> int:
    """Per-stage scalars ``<stage>/{cpu_ms,gpu_ms,self_ms,peak_allocated_mib}``; returns the count.

    With step ranges the scalars are per step (global step = step index, CPU and GPU totals of the
    stage within the step); without, the merged totals are written at global step 0.
    """
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise OutputError(f"--tensorboard needs torch and tensorboard ({exc})") from None
    groups = report.per_step or {0: report.stages}
    num = 0
    try:
        writer = SummaryWriter(log_dir=logdir)
    except OSError as exc:
        raise OutputError(f"{logdir}: cannot write ({exc})") from None
    with writer:
        for k in sorted(groups):
            for r in groups[k]:
                values = {"cpu_ms": r.cpu_ms.total, "gpu_ms": r.gpu_ms.total if r.gpu_ms else None,
                          "self_ms": r.self_ms, "peak_allocated_mib": r.peak_allocated_mib}
                for key, value in values.items():
                    if value is not None:
                        writer.add_scalar(f"{r.name}/{key}", value, global_step=k)
                        num += 1
    return num


__all__ = ["OutputError", "plot_breakdown", "write_tensorboard", "STEP_NAME"]

"""``--tensorboard DIR``: the report's per-step stage figures as TensorBoard scalars.

Same layout and tag names as the live scalars of ``opsd_profiler`` (docs/profiling.md): one run per
rank (``DIR/rank{R}``), tags ``opsd/<stage>/cpu_ms``, ``opsd/<stage>/gpu_ms``,
``opsd/<stage>/peak_allocated_mib`` (plus ``opsd/<stage>/self_ms`` here), x = the training step
index (the N of torch.profiler's ``ProfilerStep#N`` around each step range, which ``opsd_profiler``
keeps equal to ``OPSD_PROFILE_STEPS``'s numbering). Without step ranges, each rank's totals are
written at step 0.
"""

from __future__ import annotations

import os

from traces.report import Report
from traces.records import StageRow

#: Scalars per row and tag suffix.
TAGS = ("cpu_ms", "gpu_ms", "self_ms", "peak_allocated_mib")


class OutputError(Exception):
    """An optional output that cannot be produced (missing library, unwritable path)."""


def scalars(row: StageRow) -> dict[str, float]:
    """The scalars of one row by tag suffix (absent when null)."""
    values = {"cpu_ms": row.cpu_ms.total, "gpu_ms": row.gpu_ms.total if row.gpu_ms else None,
              "self_ms": row.self_ms, "peak_allocated_mib": row.peak_allocated_mib}
    return {k: v for k, v in values.items() if v is not None}


def _groups(report: Report) -> dict[int, dict[int, list[StageRow]]]:
    """rank -> step -> rows."""
    out: dict[int, dict[int, list[StageRow]]] = {}
    if report.per_rank_step:
        for (rank, step), rows in report.per_rank_step.items():
            out.setdefault(rank, {})[step] = rows
        return out
    per_rank = report.per_rank or {report.ranks[0] if report.ranks else 0: report.stages}
    return {rank: {0: rows} for rank, rows in per_rank.items()}


def write_tensorboard(report: Report, logdir: str) -> int:
    """Write the scalars (see the module docstring); returns how many were written."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise OutputError(f"--tensorboard needs torch and tensorboard ({exc})") from None
    num = 0
    for rank, steps in sorted(_groups(report).items()):
        try:
            writer = SummaryWriter(log_dir=os.path.join(logdir, f"rank{rank}"))
        except OSError as exc:
            raise OutputError(f"--tensorboard {logdir}: cannot write ({exc})") from None
        with writer:
            for step in sorted(steps):
                for row in steps[step]:
                    for key, value in scalars(row).items():
                        writer.add_scalar(f"{row.name}/{key}", value, global_step=step)
                        num += 1
    return num

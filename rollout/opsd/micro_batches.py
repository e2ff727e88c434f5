"""Micro-batches of the OPSD step: which rows the student, and the teacher, process together.

Pure logic on host integers (no torch): the step computes :class:`RowStats` in the one host sync it
already makes, plans here, and runs the plan.

Order. Rows without a loss position are left out (they add nothing to the loss or its gradient).
With ``max_student_rows=None`` the other rows keep their order and form one micro-batch (the step of
old). Otherwise they are taken longest response first (then longest prompt), so that rows of like
length share a micro-batch, and each micro-batch's inputs are cut to its own columns: the columns
before its longest prompt and after its longest response are padding in every one of its rows
(left-padded prompts, right-padded responses, a causal model: cutting them changes no logit).

Sizes. ``max_student_rows``: an int gives the fewest micro-batches of at most that many rows, their
sizes differing by at most one; ``"auto"`` packs rows in order while the micro-batch's estimated
memory (:class:`RowCost`, :mod:`rollout.opsd.sizing`) stays within the budget (at least one row).
``max_teacher_rows`` cuts the same order into teacher forwards: ``"auto"`` one per student
micro-batch, None one for all rows, an int the fewest chunks of at most that many rows.

Data parallel. Under ZeRO-2/3 each forward and backward runs collectives, so every rank must run as
many as the others: :func:`agree` splits a rank's largest micro-batches (and teacher chunks) until it
has the agreed (largest) counts.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Optional, Sequence, Union

from rollout.checks import ceil_div, require

#: The automatic setting of ``max_student_rows`` / ``max_teacher_rows``.
AUTO = "auto"
#: ``[start, stop)`` into :attr:`MicroBatchPlan.order`.
Span = tuple[int, int]
RowsSetting = Union[int, str, None]


@dataclass(frozen=True)
class RowStats:
    """Per-row host figures of a batch (rows in the batch's order)."""

    num_positions: tuple[int, ...]
    """Loss positions of each row (response tokens the loss reads)."""
    response_extent: tuple[int, ...]
    """Columns from the first response column through the row's last real token (0: none)."""
    first_column: tuple[int, ...]
    """First real column of the row in the student's input."""
    teacher_first_column: tuple[int, ...]
    """First real column of the row in the teacher's input."""
    response_column: int
    """First response column of the student's input."""
    teacher_response_column: int
    """First response column of the teacher's input."""
    num_tokens: tuple[int, ...] = ()
    """Real tokens of each row in the student's input (the packed path's token count; empty: unknown)."""

    def tokens(self, rows: Sequence[int], packed: bool) -> int:
        """Tokens a micro-batch of ``rows`` computes: their real tokens packed, rows x columns padded."""
        if packed:
            return sum(self.num_tokens[row] for row in rows)
        first, stop, _ = self.columns(rows)
        return len(rows) * (stop - first)

    def columns(self, rows: Sequence[int], teacher: bool = False) -> tuple[int, int, int]:
        """``(first, stop, kept)`` for ``rows``: input columns ``first:stop`` hold every real token
        of theirs, and the last ``kept`` logits cover every loss position."""
        extent = max(self.response_extent[row] for row in rows)
        response = self.teacher_response_column if teacher else self.response_column
        starts = self.teacher_first_column if teacher else self.first_column
        first = min(min(starts[row] for row in rows), response - 1)  # position response-1 is kept
        return first, response + extent, extent + 1


@dataclass(frozen=True)
class RowCost:
    """Estimated memory of a micro-batch: per input token, per kept logits position, and fixed."""

    bytes_per_token: float
    """Per input column of a row: the student's activations kept for backward (+ teacher scratch)."""
    bytes_per_position: float
    """Per kept logits position of a row: student logits and their gradient, teacher logits, cache."""
    fixed_bytes: float
    """Per micro-batch whatever its size (the packed loss's float32 head-gradient accumulator)."""
    packed: bool = False
    """Rows packed without padding (each row costs its own tokens and loss positions), else padded to the
    micro-batch's columns."""
    chunk_bytes_per_position: float = 0.0
    """The loss's and the cache's chunk scratch per position of a chunk (float32 temporaries over the vocabulary)."""
    chunk_size: int = 0
    """Positions of a loss chunk (``OPSDConfig.loss_chunk_size``); a micro-batch's chunk holds at most its own
    positions (a chunk size of 10**18 once estimated 2.29e13 GiB a row)."""

    def micro_batch_bytes(self, stats: RowStats, rows: Sequence[int]) -> float:
        if self.packed:
            positions = sum(stats.num_positions[row] for row in rows)
            return (stats.tokens(rows, True) * self.bytes_per_token + positions * self.bytes_per_position
                    + self.fixed_bytes + min(self.chunk_size, positions) * self.chunk_bytes_per_position)
        first, stop, kept = stats.columns(rows)
        return (len(rows) * ((stop - first) * self.bytes_per_token + kept * self.bytes_per_position) + self.fixed_bytes
                + min(self.chunk_size, len(rows) * kept) * self.chunk_bytes_per_position)


@dataclass(frozen=True)
class MicroBatchPlan:
    """Rows in processing order, the student's micro-batches and the teacher's forwards over them."""

    order: tuple[int, ...]
    """Batch row indices in processing order (rows without a loss position left out)."""
    groups: tuple[Span, ...]
    """Student micro-batches: consecutive spans of ``order`` covering it."""
    teacher_chunks: tuple[Span, ...]
    """Teacher forwards: consecutive spans of ``order`` covering it."""
    teacher_follows_groups: bool
    """Whether the teacher chunks are the student's micro-batches (``max_teacher_rows="auto"``)."""

    @property
    def num_rows(self) -> int:
        return len(self.order)

    def rows(self, span: Span) -> tuple[int, ...]:
        """The batch rows of ``span``."""
        return self.order[span[0]:span[1]]


def processing_order(stats: RowStats, by_length: bool) -> list[int]:
    """Rows with a loss position: batch order, or longest response (then prompt) first."""
    rows = [row for row, count in enumerate(stats.num_positions) if count > 0]
    if by_length:
        rows.sort(key=lambda row: (-stats.response_extent[row], stats.first_column[row], row))
    return rows


def even_spans(num_rows: int, num_parts: int) -> list[Span]:
    """``num_parts`` consecutive spans over ``num_rows`` rows, sizes differing by at most one."""
    base, extra = divmod(num_rows, num_parts)
    spans, start = [], 0
    for part in range(num_parts):
        stop = start + base + (1 if part < extra else 0)
        spans.append((start, stop))
        start = stop
    return spans


def budget_spans(stats: RowStats, order: Sequence[int], cost: RowCost, budget_bytes: float) -> list[Span]:
    """Greedy packing in order: a span grows while :meth:`RowCost.micro_batch_bytes` fits the budget. A row that
    alone exceeds it still runs alone, with one warning a call naming ``max_micro_batch_gib``."""
    spans, start, over = [], 0, 0.0
    while start < len(order):
        stop = start + 1
        alone = cost.micro_batch_bytes(stats, order[start:stop])
        over = max(over, alone) if alone > budget_bytes else over
        while stop < len(order) and cost.micro_batch_bytes(stats, order[start:stop + 1]) <= budget_bytes:
            stop += 1
        spans.append((start, stop))
        start = stop
    if over:
        warnings.warn(f"max_micro_batch_gib: one row needs {over / 2**30:.3g} GiB, over the micro-batch budget of "
                      f"{budget_bytes / 2**30:.3g} GiB; such rows run as micro-batches of one row, over the budget "
                      "(raise max_micro_batch_gib, or shorten the rows)", stacklevel=2)
    return spans


def split_spans(spans: Sequence[Span], num_parts: int) -> list[Span]:
    """``spans`` with the largest split in two (first one on ties) until there are ``num_parts``."""
    spans = list(spans)
    while len(spans) < num_parts:
        index = max(range(len(spans)), key=lambda i: (spans[i][1] - spans[i][0], -i))
        start, stop = spans[index]
        require(stop - start > 1, "spans", f"cannot split {len(spans)} spans of one row into {num_parts}")
        middle = start + ceil_div(stop - start, 2)
        spans[index:index + 1] = [(start, middle), (middle, stop)]
    return spans


def _spans(setting: RowsSetting, num_rows: int, auto: Optional[list[Span]]) -> list[Span]:
    if setting is None:
        return [(0, num_rows)]
    if setting == AUTO:
        return list(auto)
    return even_spans(num_rows, ceil_div(num_rows, setting))


def plan_micro_batches(stats: RowStats, max_student_rows: RowsSetting, max_teacher_rows: RowsSetting,
                       cost: RowCost, budget_bytes: float) -> MicroBatchPlan:
    """This rank's plan (see the module docstring); ``budget_bytes`` is read for ``"auto"`` only."""
    order = processing_order(stats, by_length=max_student_rows is not None)
    auto = budget_spans(stats, order, cost, budget_bytes) if max_student_rows == AUTO else None
    groups = _spans(max_student_rows, len(order), auto) if order else []
    follows = max_teacher_rows == AUTO
    chunks = groups if follows else (_spans(max_teacher_rows, len(order), None) if order else [])
    return MicroBatchPlan(tuple(order), tuple(groups), tuple(chunks), follows)


def agree(plan: MicroBatchPlan, num_groups: int, num_chunks: int) -> MicroBatchPlan:
    """``plan`` with exactly ``num_groups`` micro-batches and ``num_chunks`` teacher forwards (each
    at least the plan's own), splitting its largest spans; ValueError when it has too few rows."""
    require(num_groups >= len(plan.groups) and num_chunks >= len(plan.teacher_chunks), "num_groups",
             "an agreed count cannot be below the plan's own")
    needed = max(num_groups, num_chunks)
    require(plan.num_rows >= needed, "max_student_rows",
             f"the data-parallel ranks must run {num_groups} micro-batches and {num_chunks} teacher forwards "
             f"each, but this rank has only {plan.num_rows} rows with a loss position; give every rank as "
             "many rows, or set max_student_rows/max_teacher_rows to an int")
    groups = tuple(split_spans(plan.groups, num_groups))
    chunks = groups if plan.teacher_follows_groups else tuple(split_spans(plan.teacher_chunks, num_chunks))
    return replace(plan, groups=groups, teacher_chunks=chunks)

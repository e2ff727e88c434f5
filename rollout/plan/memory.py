"""The KV memory budget of a call (pure Python): what each route needs, how many slots fit, refusals.

Bytes counted per call: the KV cache (rows x columns x bytes per column) plus what grows with the rows
besides it, per row: the decode buffers and the logits of one step with the sampler's temporaries
(``row_overhead_bytes``). ``RolloutConfig.max_cache_gib`` caps the KV cache; the memory the device has
free caps everything. A call that cannot fit even its smallest form is refused before any allocation,
with the figures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rollout.checks import round_up
from rollout.plan.buckets import batch_bucket, storage_columns
from rollout.plan.layout import PromptLayout, continuous_cache_shape, default_capacity

GIB = 2**30
#: Float32 copies of a step's logits the sampler may hold at once (logits, scores, noise, a mask).
LOGIT_COPIES = 4


@dataclass(frozen=True)
class MemoryNeed:
    """What one route form of a call needs."""

    rows: int
    """Rows of the cache (slots for the continuous route)."""
    columns: int
    """Columns of the cache."""
    column_bytes: int
    """Bytes of one cache column of one row (keys + values, all layers)."""
    row_overhead_bytes: int
    """Bytes per row besides the cache (decode buffers, one step's logits and sampler temporaries)."""
    stored_columns: int = 0
    """Columns the storage allocates (``rollout.plan.buckets.storage_columns``; 0: ``columns``)."""

    @property
    def allocated_columns(self) -> int:
        return max(self.columns, self.stored_columns)

    @property
    def cache_bytes(self) -> int:
        return self.rows * self.allocated_columns * self.column_bytes

    @property
    def total_bytes(self) -> int:
        return self.cache_bytes + self.rows * self.row_overhead_bytes


def row_overhead_bytes(vocab_size: int, max_new_tokens: int, columns: int) -> int:
    """Per-row bytes besides the KV cache: generated tokens (int64), validity (bool), repetition history
    (bool over the vocabulary), and ``LOGIT_COPIES`` float32 rows of logits."""
    return max_new_tokens * 8 + columns + vocab_size + LOGIT_COPIES * vocab_size * 4


@dataclass(frozen=True)
class Budget:
    """The limits a call must fit."""

    cache_bytes: Optional[int]
    """``max_cache_gib`` in bytes, or None (no cap beyond free memory)."""
    free_bytes: Optional[int]
    """Memory the device has free (what the allocator holds unused included), or None when unknown."""

    def fits(self, need: MemoryNeed) -> bool:
        return ((self.cache_bytes is None or need.cache_bytes <= self.cache_bytes)
                and (self.free_bytes is None or need.total_bytes <= self.free_bytes))

    def max_rows(self, need: MemoryNeed) -> Optional[int]:
        """Most rows of ``need``'s shape that fit (None: no limit)."""
        limits = []
        if self.cache_bytes is not None:
            limits.append(self.cache_bytes // max(need.allocated_columns * need.column_bytes, 1))
        if self.free_bytes is not None:
            limits.append(self.free_bytes // max(need.allocated_columns * need.column_bytes + need.row_overhead_bytes,
                                                  1))
        return min(limits) if limits else None

    def describe(self) -> str:
        parts = []
        if self.cache_bytes is not None:
            parts.append(f"max_cache_gib={self.cache_bytes / GIB:.3g}")
        if self.free_bytes is not None:
            parts.append(f"{self.free_bytes / GIB:.3g} GiB free on the device")
        return " and ".join(parts) or "no limit"


def refusal(need: MemoryNeed, budget: Budget, what: str, hint: str) -> str:
    """The message of a call refused for memory: what it needs against what the budget allows."""
    stored = f" (stored as {need.allocated_columns})" if need.allocated_columns != need.columns else ""
    return (f"max_cache_gib: {what} needs a KV cache of {need.rows} rows x {need.columns} columns{stored} = "
            f"{need.cache_bytes / GIB:.3g} GiB ({need.total_bytes / GIB:.3g} GiB with its per-row buffers); "
            f"the budget is {budget.describe()}. {hint}")


@dataclass(frozen=True)
class CallMemory:
    """The memory-relevant shape of one call."""

    layout: PromptLayout
    num_samples: int
    max_new_tokens: int
    vocab_size: int
    column_bytes: int
    static_buffers: bool
    """The ordinary route decodes from static buffers (our step): its cache holds a batch bucket of rows."""
    continuous_static_buffers: bool
    """The continuous route decodes from static buffers (our step with CUDA graphs on)."""
    prompt_multiple: int = 1
    """The ordinary route pads its prompts in front to a multiple of this many columns (its step reading each prompt
    from its run's first row: ``rollout.executors.decode.prompt_sharing``)."""
    head_column_bytes: int = 0
    """One KV head's key column in bytes where the storage's width is padded (``CacheShape.padded_head_bytes``;
    0: not padded)."""

    @property
    def num_rows(self) -> int:
        return self.layout.num_prompts * self.num_samples

    def ordinary(self) -> MemoryNeed:
        rows = batch_bucket(self.num_rows) if self.static_buffers else self.num_rows
        columns = round_up(self.layout.padded_len, self.prompt_multiple) + self.max_new_tokens
        return self._need(rows, columns)

    def continuous(self, slots: int, rounded: bool = True) -> MemoryNeed:
        """``rounded``: static buffers' capacity rounded up to the length bucket (fewer distinct shapes
        across calls); without it, the 64-column multiple the route needs."""
        capacity = None if rounded else default_capacity(self.layout.spans, self.max_new_tokens, slots < self.num_rows)
        rows, columns = continuous_cache_shape(self.layout, self.max_new_tokens, slots, self.num_rows,
                                               self.continuous_static_buffers, capacity)
        return self._need(rows, columns)

    def _need(self, rows: int, columns: int) -> MemoryNeed:
        return MemoryNeed(rows, columns, self.column_bytes,
                          row_overhead_bytes(self.vocab_size, self.max_new_tokens, columns),
                          storage_columns(columns, self.head_column_bytes))


@dataclass(frozen=True)
class SlotPlan:
    """Continuous batching sized to the budget."""

    slots: int
    capacity: Optional[int] = None
    """Columns to use instead of the route's default (None: the default)."""


def slots_within_budget(call: CallMemory, route: str, requested: Optional[int], budget: Budget) -> Optional[SlotPlan]:
    """Slots (and capacity) of continuous batching under ``budget``; None when the call runs as planned
    (the ordinary route, or Auto with every row in one batch).

    ``route="ordinary"`` must fit as a whole; ``"auto"`` keeps its plan when every row fits at once and
    otherwise becomes continuous batching with the slots that fit; ``"continuous"`` gets at most the
    slots that fit. Slots are whole prompts (a prompt's samples are admitted together); the static
    buffers' rounded capacity gives way to the exact one when that fits more. ``ValueError`` naming
    ``max_cache_gib`` when not even one prompt's samples fit.
    """
    rows = call.num_rows
    if route == "ordinary":
        need = call.ordinary()
        if not budget.fits(need):
            raise ValueError(refusal(need, budget, f"the ordinary route ({rows} rows)",
                                     "Use route='auto' or 'continuous' (fewer rows at once), fewer rows, or a "
                                     "larger max_cache_gib."))
        return None
    wanted = rows if requested is None else min(requested, rows)
    if route == "auto" and wanted >= rows and budget.fits(call.ordinary()):
        return None
    rounded = _fitting_slots(call, wanted, budget, rounded=True)
    if rounded >= wanted:
        return SlotPlan(rounded)
    exact = _fitting_slots(call, wanted, budget, rounded=False)
    if exact > rounded:  # the static buffers' rounding costs slots under this budget: drop it
        return SlotPlan(exact, call.continuous(exact, rounded=False).columns)
    if rounded >= call.num_samples:
        return SlotPlan(rounded)
    need = call.continuous(call.num_samples, rounded=False)
    raise ValueError(refusal(need, budget, f"one prompt's {call.num_samples} samples",
                             "Use fewer samples per prompt, shorter prompts or budgets, or a larger max_cache_gib."))


def _fitting_slots(call: CallMemory, wanted: int, budget: Budget, rounded: bool) -> int:
    """The most slots up to ``wanted``, whole prompts, whose cache fits (below ``num_samples``: none)."""
    n = call.num_samples
    slots = wanted - wanted % n or n
    while slots >= n and not budget.fits(call.continuous(slots, rounded)):
        limit = budget.max_rows(call.continuous(slots, rounded))
        smaller = min(slots - n, limit if limit is not None else slots)
        slots = smaller - smaller % n
    return slots

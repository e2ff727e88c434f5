"""Where the prompts' real tokens are, and the host-side decisions that follow from it (pure Python).

The layout is read from the left-padded prompt mask once per call, in the same host sync as the
input checks (:func:`rollout.ops.masks.layout_tensors`); every later decision (route, prefill
buckets, slots, capacity) is made from it without touching the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from rollout.checks import is_int, round_up
from rollout.plan.buckets import batch_bucket, length_round

CONTINUOUS_ROUTES = ("continuous", "auto")


@dataclass(frozen=True)
class RowSpans:
    """Real tokens of each row of a left-padded block: host ints, in row order."""

    real_counts: tuple[int, ...]
    """Real (mask 1) tokens per row: the position id of the row's first generated token."""
    first_cols: tuple[int, ...]
    """Column of the row's first real token in the block."""


@dataclass(frozen=True)
class PromptLayout:
    """Where each prompt's real tokens are, read once from the left-padded mask ``[B, T_p]``."""

    spans: tuple[int, ...]
    """Effective length per prompt: ``T_p`` minus the leading padding (holes inside stay, masked)."""
    real_counts: tuple[int, ...]
    """Real tokens per prompt (mask sum): the position id of its first generated token."""
    padded_len: int
    """``T_p``, the width the ordinary route pads every row to."""

    @property
    def num_prompts(self) -> int:
        return len(self.spans)

    def expanded(self, num_samples: int) -> RowSpans:
        """The rows of the expanded batch (row ``i`` is prompt ``i // num_samples``) in ``[B*n, T_p]``."""
        counts = tuple(c for c in self.real_counts for _ in range(num_samples))
        firsts = tuple(self.padded_len - s for s in self.spans for _ in range(num_samples))
        return RowSpans(counts, firsts)


def layout_from_lists(counts: Sequence[int], firsts: Sequence[int], padded_len: int) -> PromptLayout:
    """The layout from host copies of each row's real-token count and first real column."""
    if min(counts) < 1:
        raise ValueError("prompt_attention_mask: every row needs at least one prompt token (a row is all 0)")
    return PromptLayout(tuple(padded_len - f for f in firsts), tuple(counts), padded_len)


def resolve_num_slots(num_slots: Optional[int], num_rows: int, num_samples: int) -> int:
    """Slots to use: ``num_slots`` (``SamplingConfig.continuous_batch_size``) or all rows, at most all rows."""
    if num_slots is None:
        return num_rows
    if not is_int(num_slots) or num_slots < num_samples:
        raise ValueError(f"continuous_batch_size: must be an int >= n_samples_per_prompt={num_samples} "
                         f"(a prompt's samples are admitted together); got {num_slots!r}")
    return min(num_slots, num_rows)


#: Refill once this fraction of the slots is free (at least one prompt's samples): fewer, larger
#: admission waves. A prefill pass costs tens of milliseconds of host time however few its tokens
#: (docs/BENCHMARKS.md, the 3B trace of 2026-12-01: 49 ms for one pass of 16 prompts), worth several
#: decode steps of the slots left idle while waiting.
REFILL_FRACTION = 8


def refill_threshold(num_slots: int, num_samples: int) -> int:
    """Free slots that trigger an admission wave: ``num_slots // REFILL_FRACTION``, at least ``num_samples``."""
    return min(num_slots, max(num_samples, num_slots // REFILL_FRACTION))


def min_capacity(spans: Sequence[int], max_new_tokens: int) -> int:
    """Fewest columns that can serve every request: its span plus the tokens it feeds back (budget - 1)."""
    return max(spans) + max_new_tokens - 1


def default_capacity(spans: Sequence[int], max_new_tokens: int, has_refills: bool, multiple: int = 64) -> int:
    """``min_capacity`` without refills (the front only advances: no trim ever); twice that with refills, so
    a trim (which moves at most the live block) happens at most once per ``min_capacity`` steps.
    Rounded up to ``multiple`` so caches of nearby calls share one pool allocation."""
    return round_up(min_capacity(spans, max_new_tokens) * (2 if has_refills else 1), multiple)


def check_prefill_limit(layout: PromptLayout, max_prefill_tokens: Optional[int]) -> None:
    """Every prompt must fit one prefill forward (there is no chunked prefill)."""
    longest = max(layout.spans)
    if max_prefill_tokens is not None and longest > max_prefill_tokens:
        raise ValueError(f"routing.max_prefill_tokens: a prompt of {longest} tokens exceeds the prefill limit "
                         f"{max_prefill_tokens} (there is no chunked prefill)")


def checked_capacity(capacity: Optional[int], layout: PromptLayout, max_new_tokens: int, has_refills: bool) -> int:
    """``capacity`` validated against ``min_capacity``, or ``default_capacity`` when None."""
    needed = min_capacity(layout.spans, max_new_tokens)
    if capacity is None:
        return default_capacity(layout.spans, max_new_tokens, has_refills)
    if not is_int(capacity) or capacity < needed:
        raise ValueError(f"capacity: must be an int >= {needed} (longest prompt span {max(layout.spans)} + "
                         f"max_new_tokens {max_new_tokens} - 1); got {capacity!r}")
    return capacity


def continuous_cache_shape(layout: PromptLayout, max_new_tokens: int, slots: int, num_rows: int, static: bool,
                           capacity: Optional[int] = None) -> tuple[int, int]:
    """``(rows, columns)`` of the continuous route's cache for ``slots``: ``capacity`` (validated) or the
    default. With static buffers the rows are the slots' batch bucket and a default capacity is rounded up
    to the length bucket (fewer distinct shapes: buffers and graphs are reused across calls). The one rule
    both the executor (what it allocates) and the memory budget (what it checks) use."""
    columns = checked_capacity(capacity, layout, max_new_tokens, slots < num_rows)
    if not static:
        return slots, columns
    return batch_bucket(slots), columns if capacity is not None else length_round(columns)


def check_gather(route: str, gather: str, is_zero3: bool) -> None:
    """Continuous batching runs a data-dependent sequence of forwards per rank, which ZeRO-3's per-forward
    gathering (one collective per forward, all ranks in lockstep) cannot follow: require ``gather="once"``."""
    if is_zero3 and route in CONTINUOUS_ROUTES and gather == "per_forward":
        raise ValueError(f"gather: route={route!r} under ZeRO-3 needs gather='once' (each rank runs its own "
                         "sequence of prefill buckets and decode steps); use gather='once' or route='ordinary'")

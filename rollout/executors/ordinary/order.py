"""How the ordinary route orders and prefills its batch (pure: host ints in, host ints out).

Prompts are prefilled once each, grouped by the planner's buckets (each padded to its longest prompt);
a prompt's ``n`` samples are the ``n`` adjacent rows after it, which receive copies of its keys and
values. Rows are generated in this order and each keeps its sample id (its row in the request order),
so samples and the output order do not depend on the grouping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from rollout.plan.layout import PromptLayout, RowSpans


@dataclass(frozen=True)
class RowOrder:
    """The batch's prompt order, prefill groups and sample fan-out."""

    num_samples: int
    """Rows per prompt (``n_samples_per_prompt``)."""
    prompt_rows: RowSpans
    """Real-token count and first real column of each prompt, in generation order (host ints)."""
    prompt_order: Optional[tuple[int, ...]] = None
    """Request index of each prompt in generation order; None: request order."""
    groups: Optional[tuple[tuple[int, int, int], ...]] = None
    """``(first_prompt, stop_prompt, length)`` per prefill bucket in generation order; None: one group."""

    @classmethod
    def plan(cls, layout: PromptLayout, num_samples: int, buckets: Optional[Sequence[Sequence[int]]] = None,
             lengths: Optional[Sequence[int]] = None) -> "RowOrder":
        """From the route choice's prompt buckets and their padded lengths (None: request order, one group)."""
        rows = layout.expanded(1)
        if not buckets or len(buckets) < 2:
            return cls(num_samples, rows)
        order = tuple(p for bucket in buckets for p in bucket)
        groups, first = [], 0
        for bucket, length in zip(buckets, lengths):
            groups.append((first, first + len(bucket), length))
            first += len(bucket)
        permuted = RowSpans(tuple(rows.real_counts[p] for p in order), tuple(rows.first_cols[p] for p in order))
        return cls(num_samples, permuted, order, tuple(groups))

    @property
    def num_prompts(self) -> int:
        return len(self.prompt_rows.real_counts)

    @property
    def row_order(self) -> Optional[tuple[int, ...]]:
        """Request row (``prompt * n + sample``) of each generated row; None: request order."""
        if self.prompt_order is None:
            return None
        n = self.num_samples
        return tuple(p * n + s for p in self.prompt_order for s in range(n))

    def group_spans(self, prompt_len: int) -> list[tuple[int, int, int]]:
        """The prefill groups over prompts (one group of every prompt when unplanned)."""
        return list(self.groups) if self.groups else [(0, self.num_prompts, prompt_len)]

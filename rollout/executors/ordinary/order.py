"""How the ordinary route orders and prefills its batch (pure: host ints in, host ints out).

Prompts are prefilled once each, grouped by the planner's buckets (each padded to its longest prompt);
a prompt's ``n`` samples are the ``n`` adjacent rows after it, which receive copies of its keys and
values. Rows are generated in this order and each keeps its sample id (its row in the request order),
so samples and the output order do not depend on the grouping or the order.

The order is longest first: prompts by their span (the columns from their first real token, so the decode
attention's key window) descending, buckets too. The decode attention launches one program per row and KV head
and the GPU starts them in row order, so the longest windows start first and the short ones fill the gaps they
leave at the end of the launch (longest-processing-time-first scheduling); in request or length order a
launch's last programs may be its longest ones.
"""

from __future__ import annotations

import functools
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
        """From the route choice's prompt buckets and their padded lengths (None: one group), longest first (the
        module docstring); ``prompt_order`` stays None where that is the request order."""
        rows = layout.expanded(1)
        longest_first = functools.partial(sorted, key=lambda p: (-layout.spans[p], p))
        if not buckets or len(buckets) < 2:
            order = tuple(longest_first(range(layout.num_prompts)))
            if order == tuple(range(layout.num_prompts)):
                return cls(num_samples, rows)
            return cls(num_samples, _permuted(rows, order), order)
        planned = sorted(zip(buckets, lengths), key=lambda bl: (-max((layout.spans[p] for p in bl[0]), default=0), -bl[1]))
        order, groups = [], []
        for bucket, length in planned:
            groups.append((len(order), len(order) + len(bucket), length))
            order.extend(longest_first(bucket))
        return cls(num_samples, _permuted(rows, order), tuple(order), tuple(groups))

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


def _permuted(rows: RowSpans, order) -> RowSpans:
    return RowSpans(tuple(rows.real_counts[p] for p in order), tuple(rows.first_cols[p] for p in order))

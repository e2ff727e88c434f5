"""Route choice per ``generate`` call (pure: plain data in, a decision out).

- ``"ordinary"``: one batch; one prefill pass per prompt (shared by its samples); decode through the
  fast step (CUDA graphs on GPU), compacting the batch as rows finish.
- ``"continuous"``: aligned-cache continuous batching (:mod:`rollout.executors.continuous`) with
  ``continuous_batch_size`` slots, FIFO refills and planner buckets per admission.
- ``"auto"``: per call:

  * fewer slots than rows -> continuous (the only route that honours the bound);
  * otherwise every row fits at once: Auto keeps the ordinary route's batch and fast decoder, EOS or
    not (rows that end early are compacted out of the batch into smaller graph buckets), and chooses
    only how to prefill it: one padded forward, or the planner's buckets (each padded to its longest
    prompt). Measured on the H200 with sampled long-tailed lengths (256 and 512 rows, budget 1024,
    mean length ~80, max 640-950; docs/BENCHMARKS.md, 2026-12-01 evening): the ordinary route ran
    2.32-2.46x its roofline against continuous batching's 2.62-2.73x (2.41-2.46x with EOS checks
    every 4 steps), so the earlier rule that sent EOS calls of >= 256 new tokens to continuous batching
    (chosen against ordinary-route times inflated by the EOS-graph bug fixed in 2de1de7) is gone.
    With the packed prefill (``prefill="packed"``, :mod:`rollout.model.prefill`) there is one pass over
    the weights either way and the buckets only group attention: the same decision runs on
    ``CostModel.packed()``, whose per-bucket cost is the group overhead plus attention. With
    ``prefill="varlen"`` attention is exact per row (no padding anywhere), so there is nothing to plan.
    The DP is skipped when all spans are equal or when a lower bound already shows the single forward
    is not worse (``fixed + sum of each row's own cost`` is below any plan's cost).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rollout.plan.layout import PromptLayout
from rollout.plan.planner import CostModel, plan_prefill_buckets

ORDINARY, CONTINUOUS = "ordinary", "continuous"
#: How the ordinary route prefills: HF forwards (one per bucket), the packed pass with attention per
#: bucket, or the packed pass with variable-length attention per row.
PREFILL_PATHS = ("hf", "packed", "varlen")


#: Decode steps between EOS checks per route when ``RolloutConfig.routing.eos_check_interval`` is None. Measured on
#: the H200 (docs/BENCHMARKS.md, 2026-12-01 evening; long-tail cell, 256 rows, budget 1024, two runs): the
#: continuous route at k = 4 ran 2.41x and 2.46x its roofline against 2.62x and 2.71x at k = 1 (the host
#: stops waiting for every step's EOS flags); the ordinary route gained nothing (2.77x / 2.36x at k = 4
#: against 2.37x / 2.32x at k = 1: its graphs already keep the GPU ~88% busy), so it keeps 1.
EOS_CHECK_INTERVAL = {ORDINARY: 1, CONTINUOUS: 4}


def eos_check_interval(configured: int | None, route: str) -> int:
    """The interval a call of ``route`` uses: the configured one, else the route's default."""
    return EOS_CHECK_INTERVAL[route] if configured is None else configured


@dataclass(frozen=True)
class RouteChoice:
    route: str
    """``"ordinary"`` or ``"continuous"`` (what actually runs)."""
    buckets: tuple[tuple[int, ...], ...] | None = None
    """Ordinary route only: prompt indices per prefill bucket (None: one bucket of every prompt). A prompt's
    ``n`` samples share its prefill, so buckets group prompts, not rows."""
    bucket_lengths: tuple[int, ...] | None = None
    """Padded length of each bucket (its longest span)."""
    dp_skipped: bool = True
    estimates_ms: dict = field(default_factory=dict)
    reason: str = ""


def choose_route(route: str, layout: PromptLayout, num_samples: int, num_slots: int | None,
                 cost_model: CostModel, max_tokens: int | None, prefill: str = "hf") -> RouteChoice:
    """The route and prefill plan of one call (``route`` is ``RolloutConfig.route``; ``prefill`` one of
    ``PREFILL_PATHS``: how the ordinary route would prefill)."""
    if prefill not in PREFILL_PATHS:
        raise ValueError(f"prefill: must be one of {PREFILL_PATHS}; got {prefill!r}")
    num_rows = len(layout.spans) * num_samples
    if route == ORDINARY:
        return RouteChoice(ORDINARY, reason="route=ordinary")
    if route == CONTINUOUS:
        return RouteChoice(CONTINUOUS, reason="route=continuous")
    if num_slots is not None and num_slots < num_rows:
        return RouteChoice(CONTINUOUS, reason=f"{num_rows} rows exceed continuous_batch_size={num_slots}")
    if prefill == "varlen":
        return RouteChoice(ORDINARY, reason="packed prefill, attention per row: no buckets to plan")
    spans = layout.spans
    if prefill == "packed":
        cost_model = cost_model.packed()
    single = cost_model.ordinary_prefill_cost_ms(len(spans), layout.padded_len)
    if len(set(spans)) == 1:
        return RouteChoice(ORDINARY, estimates_ms={"single": single}, reason="all prompts span alike")
    bound = cost_model.prefill_fixed_cost_ms + sum(cost_model.row_cost_ms(s) for s in spans)
    if single <= bound:
        return RouteChoice(ORDINARY, estimates_ms={"single": single, "bucketed_lower_bound": bound},
                           reason="single prefill <= lower bound of any bucketing")
    plan = plan_prefill_buckets(spans, cost_model, max_tokens)
    planned = sum(cost_model.ordinary_prefill_cost_ms(len(b), max(spans[i] for i in b)) for b in plan.buckets)
    estimates = {"single": single, "bucketed": planned, "bucketed_lower_bound": bound}
    if len(plan.buckets) == 1 or single <= planned:
        return RouteChoice(ORDINARY, dp_skipped=False, estimates_ms=estimates, reason="single prefill is cheaper")
    lengths = tuple(max(spans[i] for i in b) for b in plan.buckets)
    return RouteChoice(ORDINARY, plan.buckets, lengths, False, estimates, f"{len(plan.buckets)} prefill buckets")

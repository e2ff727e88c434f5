"""The ordinary route's loop: one padded batch, prefill then decode over a static KV cache we own.

Each stage is its own function (``prefill``, ``decode_one_token``) so the instrumentation can wrap it at
the call boundary. No ``gc.collect()`` / ``empty_cache()`` here, and at most one host sync per
``eos_check_interval`` decode steps (the "is anyone still running" check).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from instrumentation import stages
from rollout.cache.static import StaticKVCache
from rollout.config import SamplingConfig
from rollout.executors.context import CallContext
from rollout.executors.ordinary.buffers import DecodeBuffers
from rollout.model import compat, hf
from rollout.model.prefill import prefill_logits
from rollout.ops import masks
from rollout.ops.sampling import draw_seed, select_next_token
from rollout.plan.layout import RowSpans
from rollout.stats import CallStats


@dataclass(frozen=True)
class RowOrder:
    """How the batch is prefilled: rows grouped by the planner's buckets (each padded to its longest
    prompt), generated in that order and put back in request order at the end."""

    rows: RowSpans
    """Real-token count and first real column per row, in generation order (host ints)."""
    groups: Optional[tuple[tuple[int, int, int], ...]] = None
    """``(first_row, stop_row, length)`` per bucket in generation order; None: one group of every row."""
    order: Optional[tuple[int, ...]] = None
    """Request row of each generation row; None: request order."""

    @classmethod
    def plan(cls, rows: RowSpans, buckets, lengths) -> "RowOrder":
        """From the route choice's buckets (request row indices) and their padded lengths."""
        if not buckets or len(buckets) < 2:
            return cls(rows)
        order = tuple(row for bucket in buckets for row in bucket)
        groups, first = [], 0
        for bucket, length in zip(buckets, lengths):
            groups.append((first, first + len(bucket), length))
            first += len(bucket)
        permuted = RowSpans(tuple(rows.real_counts[r] for r in order), tuple(rows.first_cols[r] for r in order))
        return cls(permuted, tuple(groups), order)


@dataclass(frozen=True)
class StaticDecode:
    """The executor's static decode: buffers the step reads and writes, and the step itself."""

    buffers: DecodeBuffers
    step: Callable[[int], str]
    """``step(live_len) -> "graph" | "eager"``: one decode step of every row, from the buffers."""


@dataclass
class DecodeState:
    """Per-call decode state (views into the static buffers when the fast decoder runs)."""

    valid: torch.Tensor  # [N, capacity] bool: which cache columns hold real tokens
    next_pos: torch.Tensor  # [N] position id of the next token fed to the model
    generated: torch.Tensor  # [N, max_new_tokens] raw tokens of every step
    finished: torch.Tensor  # [N] bool: row has produced an EOS
    seen: Optional[torch.Tensor]  # [N, V] bool history for the repetition penalty (None when off)
    seed: torch.Tensor  # scalar int64: keys the sampling noise (see rollout.ops.sampling)
    rows: torch.Tensor  # [N] int64: each row's sample id
    mask_dtype: torch.dtype = torch.bool  # what compat.to_model_mask needs for this model (read once)
    num_steps: int = 0  # tokens produced so far (prefill produces the first)
    stats: CallStats = field(default_factory=CallStats)


def init_state(ctx: CallContext, prompt_ids, prompt_mask, capacity: int, buffers: Optional[DecodeBuffers],
               sample_ids: Optional[torch.Tensor]) -> DecodeState:
    """The call's decode state; views into ``buffers`` when the fast decoder runs."""
    num_rows, device, sampling = prompt_ids.shape[0], prompt_ids.device, ctx.sampling
    use_seen = sampling.repetition_penalty != 1.0
    if buffers is None:
        state = DecodeState(
            valid=masks.key_validity(prompt_mask, capacity),
            next_pos=prompt_mask.long().sum(dim=1),
            generated=torch.zeros((num_rows, sampling.max_new_tokens), dtype=torch.long, device=device),
            finished=torch.zeros(num_rows, dtype=torch.bool, device=device),
            # seen: [N, V] — the padded history, padding included (HF semantics)
            seen=torch.zeros((num_rows, ctx.vocab_size), dtype=torch.bool, device=device) if use_seen else None,
            seed=torch.full((), draw_seed(sampling), dtype=torch.long, device=device),
            rows=torch.arange(num_rows, dtype=torch.long, device=device) if sample_ids is None else sample_ids)
    else:
        buffers.reset(prompt_mask, draw_seed(sampling), sample_ids, use_seen)
        state = DecodeState(valid=buffers.valid[:num_rows, :capacity], next_pos=prompt_mask.long().sum(dim=1),
                            generated=buffers.generated[:num_rows, :sampling.max_new_tokens],
                            finished=buffers.finished[:num_rows],
                            seen=buffers.seen[:num_rows] if use_seen else None, seed=buffers.seed,
                            rows=buffers.rows[:num_rows])
    if state.seen is not None:
        state.seen.scatter_(1, prompt_ids.long(), True)
    state.mask_dtype = compat.mask_dtype(ctx.model)
    return state


def _emit(ctx: CallContext, state: DecodeState, logits: torch.Tensor) -> torch.Tensor:
    step = torch.full((), state.num_steps, dtype=torch.long, device=logits.device)  # a fill, no host->device copy
    tokens = select_next_token(logits, ctx.sampling, state.seen, state.seed, state.rows, step)  # [N]
    state.generated[:, state.num_steps] = tokens
    if state.seen is not None:
        state.seen.scatter_(1, tokens[:, None], True)
    if ctx.eos.tensor is not None:
        state.finished |= torch.isin(tokens, ctx.eos.tensor)
    state.num_steps += 1
    return tokens


def prefill(ctx: CallContext, cache: StaticKVCache, prompt_ids, prompt_mask, state: DecodeState,
            order: RowOrder) -> torch.Tensor:
    """Write the prompts into cache columns ``[0, T_p)`` and produce the first token of every row: our
    packed prefill (one pass over the weights for all buckets, attention per bucket) or one HF forward
    per bucket."""
    prompt_len, num_rows = prompt_ids.shape[1], prompt_ids.shape[0]
    groups = list(order.groups) if order.groups else None
    state.stats.prefill_rows += num_rows
    state.stats.prefill_tokens += sum((stop - first) * length for first, stop, length in
                                      groups or [(0, num_rows, prompt_len)])
    if ctx.fast_prefill is not None:
        logits = prefill_logits(ctx.fast_prefill, cache.key_storage[:, :num_rows], cache.value_storage[:, :num_rows],
                                prompt_ids, prompt_mask, groups, order.rows)
        state.stats.prefill_forwards += 1
        state.stats.prefill_attention_groups += len(groups or [None])
        return _emit(ctx, state, logits)
    logits = []
    for first, stop, length in groups or [(0, num_rows, prompt_len)]:
        cols = slice(prompt_len - length, prompt_len)
        logits.append(hf.prefill_forward(ctx.model, cache.rows(first, stop) if groups else cache,
                                         prompt_ids[first:stop, cols], prompt_mask[first:stop, cols], prompt_len,
                                         state.mask_dtype))
        state.stats.prefill_forwards += 1
        state.stats.prefill_attention_groups += 1
    return _emit(ctx, state, logits[0] if len(logits) == 1 else torch.cat(logits))


def decode_one_token(ctx: CallContext, cache: StaticKVCache, tokens: torch.Tensor, prompt_len: int,
                     state: DecodeState) -> torch.Tensor:
    """Feed the last tokens (column ``T_p + k - 1``) through the HF layers and produce token ``k``."""
    col = prompt_len + state.num_steps - 1
    cache.set_window(torch.full((1,), col, dtype=torch.long, device=tokens.device), col + 1)
    positions = state.next_pos + (state.num_steps - 1)  # [N]
    logits = hf.decode_forward(ctx.model, cache, tokens, positions, masks.decode_mask(state.valid, col + 1),
                               state.mask_dtype)
    state.stats.count_decode("hf", tokens.shape[0])
    return _emit(ctx, state, logits)


def generate_ordinary(ctx: CallContext, cache: StaticKVCache, prompt_ids, prompt_mask, order: RowOrder,
                      static: Optional[StaticDecode] = None) -> DecodeState:
    """Prefill then decode until every row has finished (EOS) or the budget is spent.

    ``ctx.busy(local_busy)`` returns whether any rank still runs; every rank calls it at the same steps,
    so all ranks run the same number of forwards. ``static`` runs the decode steps through our fused
    step from static buffers (CUDA graphs on GPU); None runs them through the HF layers.
    """
    prompt_len = prompt_ids.shape[1]
    sample_ids = None
    if order.order is not None:
        index = torch.tensor(order.order, device=prompt_ids.device)
        prompt_ids, prompt_mask, sample_ids = prompt_ids[index], prompt_mask[index], index
    state = init_state(ctx, prompt_ids, prompt_mask, cache.shape.capacity, static and static.buffers, sample_ids)
    with ctx.stage(stages.PREFILL):
        tokens = prefill(ctx, cache, prompt_ids, prompt_mask, state, order)
    if static is not None:
        static.buffers.start(tokens, state.next_pos, prompt_len)
    _decode_loop(ctx, cache, tokens, prompt_len, state, static)
    if sample_ids is not None:  # back to request order
        state.generated = state.generated.index_select(0, torch.argsort(sample_ids))
    return state


def _decode_loop(ctx: CallContext, cache, tokens, prompt_len: int, state: DecodeState,
                 static: Optional[StaticDecode]) -> None:
    interval, num_rows = ctx.eos_check_interval, tokens.shape[0]
    while state.num_steps < ctx.sampling.max_new_tokens:
        if ctx.eos.tensor is not None and state.num_steps % interval == 0:
            state.stats.host_syncs += 1
            if not ctx.busy(not bool(state.finished.all())):
                break
        with ctx.stage(stages.DECODE):
            if static is None:
                tokens = decode_one_token(ctx, cache, tokens, prompt_len, state)
            else:
                state.stats.count_decode(static.step(prompt_len + state.num_steps), num_rows)
                state.num_steps += 1

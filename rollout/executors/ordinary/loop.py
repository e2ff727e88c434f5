"""The ordinary route's loop: one batch, prefill then decode over a static KV cache we own.

Each stage is its own function (``prefill``, ``decode_one_token``) so the instrumentation can wrap it at
the call boundary. No ``gc.collect()`` / ``empty_cache()`` here, and at most one host sync per
``eos_check_interval`` decode steps (the "is anyone still running" check). Every prompt is prefilled
once; its ``n`` samples get copies of its keys and values (:mod:`.order`). Decoding from static buffers,
the batch shrinks as rows finish: at an EOS check where the unfinished rows fit a smaller batch bucket,
they are compacted into the leading rows and later steps run the smaller bucket.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from instrumentation import stages
from rollout.cache.pool import ScratchArena
from rollout.cache.static import StaticKVCache
from rollout.executors.context import CallContext
from rollout.executors.ordinary.buffers import DecodeBuffers
from rollout.executors.ordinary.order import RowOrder
from rollout.model import compat, hf
from rollout.model.prefill import prefill_logits
from rollout.ops import masks
from rollout.ops.host import LaggedReads
from rollout.ops.sampling import draw_seed, prompt_history
from rollout.plan.buckets import batch_bucket
from rollout.stats import CallStats


@dataclass(frozen=True)
class PromptBatch:
    """The call's prompts, once per prompt and once per row (``n`` adjacent copies), request order."""

    prompt_ids: torch.Tensor  # [B, T_p] left-padded
    prompt_mask: torch.Tensor  # [B, T_p]
    ids: torch.Tensor  # [B*n, T_p]
    mask: torch.Tensor  # [B*n, T_p]

    def left_padded(self, multiple: int) -> "PromptBatch":
        """The same prompts behind enough columns of padding (masked, never prefilled) that ``T_p`` is a multiple of
        ``multiple``: the prompts then end at a tile edge, so reads of whole prompt tiles cover every prompt column."""
        extra = -self.ids.shape[1] % multiple
        if not extra:
            return self
        return PromptBatch(*(torch.cat([t.new_zeros(t.shape[0], extra), t], dim=1)
                             for t in (self.prompt_ids, self.prompt_mask, self.ids, self.mask)))


@dataclass(frozen=True)
class StaticDecode:
    """The executor's static decode: buffers the step reads and writes, and the step itself."""

    buffers: DecodeBuffers
    step: Callable[[int, int], str]
    """``step(live_len, bucket) -> "graph" | "eager"``: one decode step of rows ``[0, bucket)``."""
    shares_prefix: Callable[[int], bool] = lambda bucket: False
    """Whether a step of ``bucket`` rows reads each prompt's columns once for its samples."""


@dataclass
class DecodeState:
    """Per-call decode state (views into the static buffers when the fast decoder runs)."""

    valid: torch.Tensor  # [N, capacity] bool: which cache columns hold real tokens
    next_pos: torch.Tensor  # [N] position id of the next token fed to the model
    generated: torch.Tensor  # [N (+ padding rows), max_new_tokens] raw tokens, row = sample id
    finished: torch.Tensor  # [N] bool: row has produced an EOS
    seen: Optional[torch.Tensor]  # [N, V] bool history for the repetition penalty (None when off)
    seed: torch.Tensor  # scalar int64: keys the sampling noise (see rollout.ops.sampling)
    rows: torch.Tensor  # [N] int64: each row's sample id (its row in the request order)
    logprobs: Optional[torch.Tensor] = None  # [N (+ padding rows), max_new_tokens] fp32, row = sample id
    mask_dtype: torch.dtype = torch.bool  # what compat.to_model_mask needs for this model (read once)
    num_steps: int = 0  # tokens produced so far (prefill produces the first)
    stats: CallStats = field(default_factory=CallStats)


def init_state(ctx: CallContext, ids, mask, capacity: int, buffers: Optional[DecodeBuffers],
               sample_ids: Optional[torch.Tensor]) -> DecodeState:
    """The call's decode state for rows ``ids``/``mask`` ``[N, T_p]`` in generation order."""
    num_rows, device, sampling = ids.shape[0], ids.device, ctx.sampling
    use_seen = sampling.repetition_penalty != 1.0
    if sample_ids is None:
        sample_ids = torch.arange(num_rows, dtype=torch.long, device=device)
    if buffers is None:
        state = DecodeState(
            valid=masks.key_validity(mask, capacity), next_pos=mask.long().sum(dim=1),
            generated=torch.zeros((num_rows, sampling.max_new_tokens), dtype=torch.long, device=device),
            finished=torch.zeros(num_rows, dtype=torch.bool, device=device),
            # seen: [N, V] — the history from each row's first real prompt token on (sampling.prompt_history)
            seen=torch.zeros((num_rows, ctx.vocab_size), dtype=torch.bool, device=device) if use_seen else None,
            seed=torch.full((), draw_seed(sampling), dtype=torch.long, device=device), rows=sample_ids,
            logprobs=torch.zeros((num_rows, sampling.max_new_tokens), device=device) if ctx.with_logprobs else None)
    else:
        buffers.reset(mask, draw_seed(sampling), sample_ids, use_seen,
                      None if ctx.row_budgets is None else ctx.row_budgets.tensor)
        state = DecodeState(valid=buffers.valid[:num_rows, :capacity], next_pos=mask.long().sum(dim=1),
                            generated=buffers.generated, finished=buffers.finished[:num_rows],
                            seen=buffers.seen[:num_rows] if use_seen else None, seed=buffers.seed,
                            rows=buffers.rows[:num_rows], logprobs=buffers.logprobs if ctx.with_logprobs else None)
    if state.seen is not None:
        state.seen.scatter_(1, prompt_history(ids, mask), True)
    state.mask_dtype = compat.mask_dtype(ctx.model)
    return state


def _emit(ctx: CallContext, state: DecodeState, logits: torch.Tensor) -> torch.Tensor:
    step = torch.full((), state.num_steps, dtype=torch.long, device=logits.device)  # a fill, no host->device copy
    tokens, logprobs = ctx.sampler(logits, state.seen, state.seed, state.rows, step, ctx.with_logprobs)  # [N]
    state.generated.index_put_((state.rows, step.expand_as(state.rows)), tokens)
    if logprobs is not None:
        state.logprobs.index_put_((state.rows, step.expand_as(state.rows)), logprobs)
    if state.seen is not None:
        state.seen.scatter_(1, tokens[:, None], True)
    if ctx.eos.tensor is not None:
        state.finished |= torch.isin(tokens, ctx.eos.tensor)
    if ctx.row_budgets is not None:  # the row's own budget reached with this token
        state.finished |= ctx.row_budgets.tensor.index_select(0, state.rows) <= state.num_steps + 1
    state.num_steps += 1
    return tokens


def prefill(ctx: CallContext, cache: StaticKVCache, prompt_ids, prompt_mask, state: DecodeState, order: RowOrder,
            scratch: Optional[ScratchArena]) -> torch.Tensor:
    """Write every prompt into cache columns ``[0, T_p)`` of its rows and produce every row's first token.
    ``prompt_ids``/``prompt_mask`` ``[B, T_p]`` in generation order. With ``n > 1`` the prompts go into the
    ``scratch`` and are copied into their ``n`` rows (one prefill per prompt)."""
    num_prompts, prompt_len = prompt_ids.shape
    n = order.num_samples
    target = cache if n == 1 else scratch.get(num_prompts, prompt_len)
    groups = order.group_spans(prompt_len)
    logits = _prefill_into(ctx, target, prompt_ids, prompt_mask, state, order, groups)  # [B, V]
    ctx.logit_check.note(logits)
    state.stats.prefill.rows += num_prompts
    state.stats.prefill.tokens += sum((stop - first) * length for first, stop, length in groups)
    if n > 1:
        source = torch.arange(num_prompts * n, device=prompt_ids.device) // n  # row r <- prompt r // n
        for dst, src in ((cache.key_storage, target.key_storage), (cache.value_storage, target.value_storage)):
            dst[:, :num_prompts * n, :, :prompt_len] = src[:, :num_prompts].index_select(1, source)
        logits = logits.index_select(0, source)
    return _emit(ctx, state, logits)


def _prefill_into(ctx: CallContext, target: StaticKVCache, prompt_ids, prompt_mask, state: DecodeState,
                  order: RowOrder, groups: list[tuple[int, int, int]]) -> torch.Tensor:
    """Last-token logits ``[B, V]`` of the prompts, their keys/values written into ``target``'s rows
    ``[0, B)``: our packed prefill (one pass over the weights, attention per group) or one HF forward per
    group."""
    num_prompts, prompt_len = prompt_ids.shape
    if ctx.fast_prefill is not None:
        state.stats.prefill.forwards += 1
        state.stats.prefill.attention_groups += len(groups)
        return prefill_logits(ctx.fast_prefill, target.key_storage[:, :num_prompts],
                              target.value_storage[:, :num_prompts], prompt_ids, prompt_mask,
                              groups if order.groups else None, order.prompt_rows, ctx.prefill_graphs)
    logits = []
    for first, stop, length in groups:
        cols = slice(prompt_len - length, prompt_len)
        logits.append(hf.prefill_forward(ctx.model, target.rows(first, stop), prompt_ids[first:stop, cols],
                                         prompt_mask[first:stop, cols], prompt_len, state.mask_dtype))
        state.stats.prefill.forwards += 1
        state.stats.prefill.attention_groups += 1
    return logits[0] if len(logits) == 1 else torch.cat(logits)


def decode_one_token(ctx: CallContext, cache: StaticKVCache, tokens: torch.Tensor, prompt_len: int,
                     state: DecodeState) -> torch.Tensor:
    """Feed the last tokens (column ``T_p + k - 1``) through the HF layers and produce token ``k``."""
    col = prompt_len + state.num_steps - 1
    cache.set_window(torch.full((1,), col, dtype=torch.long, device=tokens.device), col + 1)
    positions = state.next_pos + (state.num_steps - 1)  # [N]
    logits = hf.decode_forward(ctx.model, cache, tokens, positions, masks.decode_mask(state.valid, col + 1),
                               state.mask_dtype)
    state.stats.decode.count("hf", tokens.shape[0])
    return _emit(ctx, state, logits)


def generate_ordinary(ctx: CallContext, cache: StaticKVCache, batch: PromptBatch, order: RowOrder,
                      static: Optional[StaticDecode] = None, scratch: Optional[ScratchArena] = None) -> DecodeState:
    """Prefill then decode until every row has finished (EOS) or the budget is spent; ``generated`` rows
    are sample ids (request order) whatever the generation order.

    ``ctx.busy(local_busy)`` returns whether any rank still runs; every rank calls it at the same steps,
    so all ranks run the same number of forwards. ``static`` runs the decode steps through our fused
    step from static buffers (CUDA graphs on GPU); None runs them through the HF layers.
    """
    prompt_ids, prompt_mask, ids, mask, sample_ids = batch.prompt_ids, batch.prompt_mask, batch.ids, batch.mask, None
    if order.prompt_order is not None:
        prompts = torch.tensor(order.prompt_order, device=ids.device)
        sample_ids = torch.tensor(order.row_order, device=ids.device)
        prompt_ids, prompt_mask = prompt_ids[prompts], prompt_mask[prompts]
        ids, mask = ids[sample_ids], mask[sample_ids]
    state = init_state(ctx, ids, mask, cache.shape.capacity, static and static.buffers, sample_ids)
    with ctx.stage(stages.PREFILL):
        tokens = prefill(ctx, cache, prompt_ids, prompt_mask, state, order, scratch)
    if static is None:
        _hf_decode_loop(ctx, cache, tokens, state, prompt_ids.shape[1])
    else:
        static.buffers.start(tokens, state.next_pos, prompt_ids.shape[1])
        _static_decode_loop(ctx, cache, state, static, prompt_ids.shape[1])
    state.generated = state.generated[:ids.shape[0]]
    if state.logprobs is not None:
        state.logprobs = state.logprobs[:ids.shape[0]]
    return state


def _hf_decode_loop(ctx: CallContext, cache, tokens, state: DecodeState, prompt_len: int) -> None:
    while state.num_steps < ctx.sampling.max_new_tokens:
        if ctx.has_stops and state.num_steps % ctx.eos_check_interval == 0:
            state.stats.decode.host_syncs += 1
            if not ctx.busy(not bool(state.finished.all())):
                break
        with ctx.stage(stages.DECODE):
            tokens = decode_one_token(ctx, cache, tokens, prompt_len, state)


def _static_decode_loop(ctx: CallContext, cache, state: DecodeState, static: StaticDecode, prompt_len: int) -> None:
    """Decode steps from the static buffers; at each EOS check the unfinished rows are counted and, when
    they fit a smaller batch bucket, compacted into it.

    A check reads the count one check late: it posts the current count (a device copy, no wait) and takes
    the previous check's, whose wait ends while the step launched since keeps the GPU busy (reading the
    newest count would leave the GPU idle while the host launches the next step, at every check). A row
    that has ended stays ended, so a late count bounds the live rows from above: compaction into its
    bucket keeps every live row. When the late count is 0, every row had ended at that check's token:
    the steps run since are cut from the output (``CallStats.eos_overrun_steps``), which is therefore the
    one an up-to-date check gives. A call that reaches the budget takes the last count too.
    ``ctx.late_eos_count=False`` takes each count right after posting it (the host waits for the GPU)."""
    num_live = state.rows.shape[0]
    bucket = batch_bucket(num_live)
    finished = static.buffers.finished
    counts = LaggedReads(finished.device) if ctx.has_stops else None
    while state.num_steps < ctx.sampling.max_new_tokens:
        if counts is not None and state.num_steps % ctx.eos_check_interval == 0:
            counts.post(finished[:bucket].sum(), (state.num_steps, bucket))  # finished rows, padding included
            if len(counts) > 1 or not ctx.late_eos_count:
                done, (at_step, at_bucket) = counts.take()
                state.stats.decode.host_syncs += 1
                num_live = at_bucket - done
                if not ctx.busy(num_live > 0):
                    _cut_overrun(state, at_step)
                    return
                if batch_bucket(num_live) < bucket:
                    columns = prompt_len + state.num_steps
                    with ctx.stage(stages.CACHE_TRIM):
                        bucket = static.buffers.compact(cache, bucket, batch_bucket(num_live), columns)
                    state.stats.cache.compactions += 1
                    state.stats.cache.row_moves += bucket
                    state.stats.cache.bytes_moved += bucket * columns * cache.column_bytes
        with ctx.stage(stages.DECODE):
            state.stats.decode.count(static.step(prompt_len + state.num_steps, bucket), num_live)
            state.stats.decode.shared_prefix_steps += static.shares_prefix(bucket)
            state.num_steps += 1
    if counts:  # the budget ended the loop: the last check may show that every row had ended before it
        done, (at_step, at_bucket) = counts.take()
        state.stats.decode.host_syncs += 1
        if at_bucket - done == 0:
            _cut_overrun(state, at_step)


def _cut_overrun(state: DecodeState, at_step: int) -> None:
    """Every row had ended by token ``at_step``: the tokens decoded since are not part of the output."""
    state.stats.decode.eos_overrun_steps += state.num_steps - at_step
    state.num_steps = at_step

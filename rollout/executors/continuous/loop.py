"""The continuous-batching route: scheduler-driven refills over the aligned KV cache.

One loop iteration ("step") produces one token for every live row, following the scheduler's loop
contract (:mod:`rollout.plan.scheduler`)::

    update = scheduler.step(eos flags)   # retire on EOS/budget, compact, admit FIFO into free slots
    compaction moves                     # stage cache_trim (KV window, valid, seen, last tokens)
    trim if the front hit the capacity   # stage cache_trim
    decode the survivors                 # stage decode: one forward over rows [0, num_survivors)
    make room for the admitted prompts   # stage cache_trim (right shift, only when needed)
    plan their prefill buckets           # stage plan: plan_prefill_buckets over their spans
    per pass: scratch                    # stage cache_acquire (a view of the scratch arena)
              forward + copy + token     # stage prefill: one forward into the scratch, each bucket's
                                         #   KV copied right-aligned into its slots, first token selected

A pass is one bucket through the HF layers; with the packed prefill (``fast_prefill``) it is the whole
admission wave, whose buckets then only group attention and the KV copies (planned on
``CostModel.packed(copy_kv=True, ...)``).
    eos flags of the live rows           # the step's one host sync (none without EOS ids); with
                                         #   eos_check_interval k > 1 only every k-th step reads them
                                         #   (sticky flags on the device), so the host runs ahead

Shared prefill: a prompt with ``n`` samples is one row of its bucket; its keys/values are copied
into its ``n`` slots and its logits repeated, so each sample selects its own first token.

Repetition penalty: each slot's ``seen`` starts from the request's original padded prompt row (pad
tokens included, as the ordinary route and HF ``generate`` on that row do) and gains every token
the row emits.

Sampling: ``ctx.sampler`` (``rollout.ops.sampling``) keyed by each row's sample id (its row ``i`` in the
expanded output) and its own token index, exactly the keys of the ordinary route. Hence, for a
given seed, a sample's tokens depend only on its own logits: not on the slot count, its batch
neighbours, admission order, the bucket plan or the route. (Logits are bitwise equal across batch
shapes only up to the kernels' floating-point reassociation, so a near-tie can still resolve
differently between shapes; same inputs and shapes on the same device give the same samples.)

ZeRO-3: each rank runs its own sequence of forwards, which per-forward gathering cannot follow;
``plan.layout.check_gather`` requires ``gather="once"`` for this route (the engine calls it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from instrumentation import stages
from rollout.cache.aligned import AlignedKVCache
from rollout.cache.pool import ScratchArena
from rollout.cache.static import cache_shape
from rollout.executors.context import CallContext
from rollout.executors.continuous.prefill import admit
from rollout.executors.continuous.state import (GraphDecode, RunState, emit, extent, finished_flags, mark_done,
                                                new_run_state, record_cache, row_data)
from rollout.model import hf
from rollout.model.step import decode_logits
from rollout.ops.host import to_device
from rollout.ops.masks import layout_tensors
from rollout.plan.buckets import batch_bucket
from rollout.plan.layout import (PromptLayout, check_prefill_limit, checked_capacity, layout_from_lists,
                                 min_capacity, refill_threshold, resolve_num_slots)
from rollout.plan.scheduler import ContinuousScheduler, SchedulerConfig
from rollout.stats import CallStats


@dataclass(frozen=True)
class SlotSpec:
    """Where a continuous generation runs; every field optional."""

    num_slots: Optional[int] = None
    """Slots; default ``sampling.continuous_batch_size``, then all ``B * n`` rows."""
    capacity: Optional[int] = None
    """Columns of a cache allocated here (default ``plan.layout.default_capacity``); ignored with ``cache``."""
    cache: Optional[AlignedKVCache] = None
    """The engine's cache (from its pool): at least ``num_slots`` slots (``batch_bucket(slots)`` with a
    ``GraphDecode``, whose buffers' ``valid``/``write_col`` it must use)."""
    arena: Optional[ScratchArena] = None
    """Scratch for bucket prefills, kept by the caller across calls; one made here is released at the end."""


@dataclass
class ContinuousResult:
    """What ``generate_continuous`` returns; ``postprocess(expanded prompts, generated, ...)`` takes it on."""

    generated: torch.Tensor
    """``[B*n, S]`` raw tokens; row ``i`` is sample ``i % n`` of prompt ``i // n``. Rows that retired at
    EOS hold zeros after it (``postprocess`` cuts there); ``S`` is the longest row's token count."""
    logprobs: Optional[torch.Tensor]
    """``[B*n, S]`` float32 log-probabilities of those tokens (``SamplingConfig.return_logprobs``), else None."""
    num_steps: int
    """``S``: tokens of the longest row (the first comes from prefill)."""
    stats: CallStats
    """Counters of the call (``steps``, ``host_syncs``, ``plans``, prefill and decode counts, the cache's
    moves and bytes, the scratch arena's allocations)."""


@torch.no_grad()
def generate_continuous(ctx: CallContext, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                        layout: Optional[PromptLayout] = None, slots: SlotSpec = SlotSpec(),
                        graph: Optional[GraphDecode] = None) -> ContinuousResult:
    """Generate ``n_samples_per_prompt`` responses per prompt by continuous batching.

    ``prompt_ids``/``prompt_mask`` are the *unexpanded* request ``[B, T_p]`` (left-padded). ``layout``
    saves the one host sync of reading it from the mask when the caller already has it. ``ctx.fast``
    decodes through our step, eagerly over per-call tensors unless ``graph`` is given; None decodes
    through the HF layers. ``ctx.fast_prefill`` prefills each admission wave in one packed pass.
    """
    _check_prompts(prompt_ids, prompt_mask)
    host_syncs = 0
    if layout is None:
        layout = layout_from_lists(*layout_tensors(prompt_mask).tolist(), prompt_mask.shape[1])
        host_syncs = 1
    check_prefill_limit(layout, ctx.max_prefill_tokens)
    sampling = ctx.sampling
    num_rows = layout.num_prompts * sampling.n_samples_per_prompt
    num_slots = resolve_num_slots(sampling.continuous_batch_size if slots.num_slots is None else slots.num_slots,
                                  num_rows, sampling.n_samples_per_prompt)
    cache = slots.cache or _new_cache(ctx, layout, slots, num_slots, num_rows)
    if cache.num_slots < num_slots or cache.capacity < min_capacity(layout.spans, sampling.max_new_tokens):
        raise ValueError(f"cache: {cache.num_slots} slots x {cache.capacity} columns cannot serve {num_slots} slots "
                         f"x {min_capacity(layout.spans, sampling.max_new_tokens)} columns")
    arena = slots.arena or ScratchArena.like(cache.shape)
    run = new_run_state(ctx, cache, arena, prompt_ids, prompt_mask, layout, graph)
    run.stats.decode.host_syncs += host_syncs
    try:
        _loop(run, num_slots)
    finally:
        with ctx.stage(stages.CACHE_RELEASE):
            record_cache(run.stats, cache, arena)
            if slots.arena is None:
                arena.release()
    run.stats.decode.num_steps = run.width
    logprobs = None if run.logprobs is None else run.logprobs[:num_rows, :run.width]
    return ContinuousResult(run.generated[:num_rows, :run.width], logprobs, run.width, run.stats)


def _check_prompts(prompt_ids, prompt_mask) -> None:
    if not isinstance(prompt_ids, torch.Tensor) or prompt_ids.dim() != 2:
        raise ValueError("prompt_ids: must be a 2-D tensor [B, T_p]")
    if not isinstance(prompt_mask, torch.Tensor) or prompt_mask.shape != prompt_ids.shape:
        raise ValueError(f"prompt_mask: must be a tensor of prompt_ids' shape {tuple(prompt_ids.shape)}")


def _new_cache(ctx: CallContext, layout: PromptLayout, slots: SlotSpec, num_slots: int, num_rows: int):
    capacity = checked_capacity(slots.capacity, layout, ctx.sampling.max_new_tokens, num_slots < num_rows)
    with ctx.stage(stages.CACHE_ACQUIRE):
        return AlignedKVCache(cache_shape(ctx.model, num_slots, capacity))


# ---- the loop ----------------------------------------------------------------------------------
def _loop(run: RunState, num_slots: int) -> None:
    sampling, interval = run.ctx.sampling, run.ctx.eos_check_interval
    scheduler = ContinuousScheduler(SchedulerConfig(num_slots=num_slots, max_new_tokens=sampling.max_new_tokens,
                                                    min_free_slots=refill_threshold(num_slots, run.num_samples)))
    budgets, n = run.ctx.row_budgets, run.num_samples
    for prompt, span in enumerate(run.layout.spans):
        scheduler.submit(prompt, span, n, None if budgets is None else budgets.values[prompt * n:(prompt + 1) * n])
    run.cache.reset(front=run.suffix_max[0])
    flags: tuple | list = ()
    while True:
        update = scheduler.step(flags)
        run.width = max([run.width] + [r.num_generated for r in update.retired])
        if scheduler.idle:
            return
        rows = scheduler.rows()
        survivors = rows[:update.num_survivors]
        if update.moves:
            with run.ctx.stage(stages.CACHE_TRIM):
                _compact(run, update.moves, survivors)
        if survivors:
            _decode(run, survivors)
        if update.admitted:
            admit(run, update.admitted, survivors)
        mark_done(run, update.num_survivors, update.num_live)
        run.stats.decode.steps += 1
        flags = finished_flags(run, update.num_live, check=run.stats.decode.steps % interval == 0)


def _compact(run: RunState, moves, survivors) -> None:
    device = run.last_tokens.device
    src = to_device([m[0] for m in moves], device)
    dst = to_device([m[1] for m in moves], device)
    run.cache.move_rows(src, dst, max(extent(run, survivors[d]) for _, d in moves))
    run.last_tokens.index_copy_(0, dst, run.last_tokens.index_select(0, src))
    if run.done is not None:
        run.done.index_copy_(0, dst, run.done.index_select(0, src))
    if run.seen is not None:
        run.seen.index_copy_(0, dst, run.seen.index_select(0, src))


def _decode(run: RunState, rows) -> None:
    cache, num_rows = run.cache, len(rows)
    max_extent = max(extent(run, r) for r in rows)
    if cache.front >= cache.capacity:
        with run.ctx.stage(stages.CACHE_TRIM):
            cache.realign(num_rows, max_extent, max_extent)
    with run.ctx.stage(stages.DECODE):
        positions = [run.layout.real_counts[r.request_id] + r.num_generated - 1 for r in rows]
        sample_ids = [r.request_id * run.num_samples + r.sample_index for r in rows]
        steps = [r.num_generated for r in rows]
        keep = cache.begin_decode(num_rows, max_extent)
        if run.graph is not None:
            mode = _graph_step(run, num_rows, sample_ids, steps, positions)
        else:
            mode = _eager_step(run, num_rows, keep, row_data(run, sample_ids, steps, positions))
        cache.end_decode()
    run.stats.decode.count(mode, num_rows)


def _graph_step(run: RunState, num_rows: int, sample_ids, steps, positions) -> str:
    """Static buffers; a CUDA graph per (batch bucket, read window) on the GPU. Free slots of the bucket
    are computed along: their tokens go to the dummy row."""
    bufs, cache = run.graph.buffers, run.cache
    bucket = batch_bucket(num_rows)
    pad = bucket - num_rows
    bufs.rowdata[:, :bucket].copy_(row_data(run, sample_ids + [bufs.dummy_row] * pad, steps + [0] * pad,
                                            positions + [0] * pad))
    return run.graph.step(num_rows, cache.front, cache.read_start)


def _eager_step(run: RunState, num_rows: int, keep, packed) -> str:
    """One step over the per-call tensors: our step eagerly, or the HF layers."""
    cache, ctx = run.cache, run.ctx
    if ctx.fast is not None:
        logits = decode_logits(ctx.fast, cache.key_storage[:, :num_rows], cache.value_storage[:, :num_rows],
                               run.last_tokens[:num_rows], packed[2], cache.write_col, keep, start=cache.read_start)
    else:
        logits = hf.decode_forward(ctx.model, cache, run.last_tokens[:num_rows], packed[2], keep, run.mask_dtype)
    emit(run, slice(0, num_rows), logits, packed)
    return "hf" if ctx.fast is None else "per_call"

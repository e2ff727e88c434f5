"""The continuous-batching route: scheduler-driven refills over the aligned KV cache.

One loop iteration ("step") produces one token for every live row, following the scheduler's loop
contract (:mod:`rollout.scheduler`)::

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
    eos flags of the live rows           # the step's one host sync (none without EOS ids)

Shared prefill: a prompt with ``n`` samples is one row of its bucket; its keys/values are copied
into its ``n`` slots and its logits repeated, so each sample selects its own first token.

Repetition penalty: each slot's ``seen`` starts from the request's original padded prompt row (pad
tokens included, as the ordinary route and HF ``generate`` on that row do) and gains every token
the row emits.

Sampling: ``sampling.select_next_token`` keyed by each row's sample id (its row ``i`` in the
expanded output) and its own token index, exactly the keys of the ordinary route. Hence, for a
given seed, a sample's tokens depend only on its own logits: not on the slot count, its batch
neighbours, admission order, the bucket plan or the route. (Logits are bitwise equal across batch
shapes only up to the kernels' floating-point reassociation, so a near-tie can still resolve
differently between shapes; same inputs and shapes on the same device give the same samples.)

ZeRO-3: each rank runs its own sequence of forwards, which per-forward gathering cannot follow;
``cb_route.check_gather`` requires ``gather="once"`` for this route (the engine calls it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from instrumentation import stages
from rollout import compat, fast_decode, fast_prefill
from rollout.aligned_cache import AlignedKVCache, ScratchArena, to_device
from rollout.cb_route import (PromptLayout, check_prefill_limit, checked_capacity, min_capacity, prompt_layout,
                              resolve_num_slots)
from rollout.cb_state import (COUNTERS, RunState, cache_counters, check_args, emit, finished_flags,
                              new_run_state, row_data)
from rollout.config import SamplingConfig
from rollout.kv_cache import cache_shape
from rollout.decode_graphs import batch_bucket
from rollout.planner import DEFAULT_MAX_TOKENS, CostModel, plan_prefill_buckets
from rollout.runner import prefill_forward
from rollout.scheduler import ContinuousScheduler, SchedulerConfig


@dataclass
class ContinuousResult:
    """What ``generate_continuous`` returns; ``postprocess(expanded prompts, generated, ...)`` takes it on."""

    generated: torch.Tensor
    """``[B*n, S]`` raw tokens; row ``i`` is sample ``i % n`` of prompt ``i // n``. Rows that retired at
    EOS hold zeros after it (``postprocess`` cuts there); ``S`` is the longest row's token count."""
    num_steps: int
    """``S``: tokens of the longest row (the first comes from prefill)."""
    counters: dict = field(default_factory=dict)
    """``steps`` (scheduler iterations), ``host_syncs``, ``plans``, ``prefill_forwards`` (= passes),
    ``prefill_rows`` (distinct prompts prefilled), ``prefill_tokens`` (padded B*L summed),
    ``decode_forwards``, ``decode_rows``, ``trims``, ``shifts``, ``row_moves``, ``bytes_moved``
    (compaction + realigns), ``prefill_copy_bytes``, ``capacity``, ``num_slots``, ``cache_bytes``,
    ``scratch_bytes``, ``scratch_allocations``."""


@torch.no_grad()
def generate_continuous(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: SamplingConfig,
                        eos_ids: torch.Tensor | None, *, cost_model: CostModel, num_slots: int | None = None,
                        capacity: int | None = None, cache: AlignedKVCache | None = None,
                        arena: ScratchArena | None = None, layout: PromptLayout | None = None,
                        max_prefill_tokens: int | None = DEFAULT_MAX_TOKENS, stage=None,
                        fast: tuple | None = None, fast_prefill: tuple | None = None,
                        graph: tuple | None = None) -> ContinuousResult:
    """Generate ``sampling.n_samples_per_prompt`` responses per prompt by continuous batching.

    ``prompt_ids``/``prompt_mask`` are the *unexpanded* request ``[B, T_p]`` (left-padded).
    ``num_slots`` defaults to ``sampling.continuous_batch_size``, then to all ``B * n`` rows. ``cache``
    (the engine's, from its pool) must have at least that many slots; without one a cache of
    ``capacity`` columns (default ``cb_route.default_capacity``) is allocated. ``arena`` (scratch for
    bucket prefills) may be kept by the caller across calls; one made here is released at the end.
    ``layout`` saves the one host sync of ``prompt_layout`` when the caller already has it.
    ``stage(name)`` wraps each stage call (default: ``instrumentation.stage``). ``fast``: ``(spec,
    weights, step fns)`` of :mod:`rollout.fast_decode` to decode through our own step, eagerly over the
    per-call tensors unless ``graph`` is given; None decodes through the HF layers.
    ``fast_prefill``: the same parts to prefill each bucket through :mod:`rollout.fast_prefill`.
    ``graph``: ``(step, CBBuffers)`` (``FastDecoder.cb_stepper`` / ``cb_buffers_for``) to decode from
    static buffers, replayed from CUDA graphs on the GPU (:mod:`rollout.cb_graphs`); ``cache`` must
    then use the buffers' ``valid``/``write_col`` and have ``batch_bucket(slots)`` slots.
    """
    stage = stage or _default_stage()
    check_args(prompt_ids, prompt_mask, sampling, eos_ids, cost_model)
    counters = dict.fromkeys(COUNTERS, 0)
    if layout is None:
        layout = prompt_layout(prompt_mask)
        counters["host_syncs"] += 1
    check_prefill_limit(layout, max_prefill_tokens)
    num_rows = len(layout.spans) * sampling.n_samples_per_prompt
    slots = resolve_num_slots(sampling.continuous_batch_size if num_slots is None else num_slots, num_rows,
                              sampling.n_samples_per_prompt)
    if cache is None:
        capacity = checked_capacity(capacity, layout, sampling.max_new_tokens, slots < num_rows)
        with stage(stages.CACHE_ACQUIRE):
            cache = AlignedKVCache(cache_shape(model, slots, capacity))
    elif cache.num_slots < slots or cache.capacity < min_capacity(layout.spans, sampling.max_new_tokens):
        raise ValueError(f"cache: {cache.num_slots} slots x {cache.capacity} columns cannot serve {slots} slots x "
                         f"{min_capacity(layout.spans, sampling.max_new_tokens)} columns")
    own_arena = arena is None
    arena = arena or ScratchArena.like(cache.shape)
    run = new_run_state(model, cache, arena, sampling, eos_ids, cost_model, max_prefill_tokens, stage, prompt_ids,
                        prompt_mask, layout, counters, fast, fast_prefill, graph)
    try:
        _loop(run, slots)
    finally:
        with stage(stages.CACHE_RELEASE):
            scratch_bytes = arena.nbytes
            if own_arena:
                arena.release()
    counters.update(cache_counters(cache), scratch_bytes=scratch_bytes, scratch_allocations=arena.num_allocations)
    return ContinuousResult(run.generated[:num_rows, :run.width], run.width, counters)


# ---- the loop ----------------------------------------------------------------------------------
def _loop(run: RunState, num_slots: int) -> None:
    scheduler = ContinuousScheduler(SchedulerConfig(num_slots=num_slots, max_new_tokens=run.sampling.max_new_tokens))
    for prompt, span in enumerate(run.layout.spans):
        scheduler.submit(prompt, span, run.num_samples)
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
            with run.stage(stages.CACHE_TRIM):
                _compact(run, update.moves, survivors)
        if survivors:
            _decode(run, survivors)
        if update.admitted:
            _admit(run, update.admitted, survivors)
        flags = finished_flags(run, update.num_live)
        run.counters["steps"] += 1


def _extent(run: RunState, row, fed_this_step: int = 0) -> int:
    """Columns a live row uses: its span plus the tokens it has fed back (all produced but the newest)."""
    return run.layout.spans[row.request_id] + row.num_generated - 1 + fed_this_step


def _compact(run: RunState, moves, survivors) -> None:
    device = run.last_tokens.device
    src = to_device([m[0] for m in moves], device)
    dst = to_device([m[1] for m in moves], device)
    run.cache.move_rows(src, dst, max(_extent(run, survivors[d]) for _, d in moves))
    run.last_tokens.index_copy_(0, dst, run.last_tokens.index_select(0, src))
    if run.seen is not None:
        run.seen.index_copy_(0, dst, run.seen.index_select(0, src))


def _decode(run: RunState, rows) -> None:
    cache, num_rows = run.cache, len(rows)
    max_extent = max(_extent(run, r) for r in rows)
    if cache.front >= cache.capacity:
        with run.stage(stages.CACHE_TRIM):
            cache.realign(num_rows, max_extent, max_extent)
    with run.stage(stages.DECODE):
        positions = [run.layout.real_counts[r.request_id] + r.num_generated - 1 for r in rows]
        sample_ids = [r.request_id * run.num_samples + r.sample_index for r in rows]
        steps = [r.num_generated for r in rows]
        keep = cache.begin_decode(num_rows, max_extent)
        if run.graph is not None:  # static buffers; a CUDA graph per (batch bucket, read window) on GPU
            step, bufs = run.graph
            bucket = batch_bucket(num_rows)
            pad = bucket - num_rows  # free slots computed along: their tokens go to the dummy row
            bufs.rowdata[:, :bucket].copy_(row_data(run, sample_ids + [bufs.dummy_row] * pad, steps + [0] * pad,
                                                    positions + [0] * pad))
            mode = step(num_rows, cache.front, cache.read_start)
            run.counters[f"{mode}_decode_steps"] = run.counters.get(f"{mode}_decode_steps", 0) + 1
            cache.end_decode()
            run.counters["decode_forwards"] += 1
            run.counters["decode_rows"] += num_rows
            return
        packed = row_data(run, sample_ids, steps, positions)  # [3, n]
        if run.fast is not None:
            spec, weights, fns = run.fast
            logits = fast_decode.decode_logits(spec, weights, fns, cache.key_storage[:, :num_rows],
                                               cache.value_storage[:, :num_rows], run.last_tokens[:num_rows],
                                               packed[2], cache.write_col, keep, start=cache.read_start)
        else:
            logits = compat.forward_last_logits(run.model, run.last_tokens[:num_rows, None], packed[2][:, None],
                                                compat.to_model_mask(keep, run.model, run.mask_dtype), cache)
        cache.end_decode()
        emit(run, slice(0, num_rows), logits, packed)
    run.counters["decode_forwards"] += 1
    run.counters["decode_rows"] += num_rows


def _admit(run: RunState, admitted, survivors) -> None:
    cache, spans = run.cache, run.layout.spans
    need = max(a.prompt_length for a in admitted)
    if not survivors:
        cache.set_front(max(need, run.suffix_max[admitted[0].request_id]))
    elif cache.front < need:
        with run.stage(stages.CACHE_TRIM):
            cache.realign(len(survivors), max(_extent(run, r, 1) for r in survivors), need)
    with run.stage(stages.PLAN):
        plan = plan_prefill_buckets([a.prompt_length for a in admitted], run.plan_costs, run.max_prefill_tokens)
    run.counters["plans"] += 1
    buckets = [[admitted[j] for j in bucket] for bucket in plan.buckets]
    lengths = [max(spans[a.request_id] for a in bucket) for bucket in buckets]
    if run.fast_prefill is not None:  # one packed pass; the buckets group attention and the KV copies
        _prefill_pass(run, buckets, lengths)
        return
    for bucket, length in zip(buckets, lengths):  # one HF forward per bucket
        _prefill_pass(run, [bucket], [length])


def _prefill_pass(run: RunState, buckets, lengths: list[int]) -> None:
    """One prefill pass over the admitted requests of ``buckets`` (each left-padded to its ``length``)
    into one scratch of the widest bucket's width; each bucket's columns are then copied into its
    slots, and the slots get their first token. With the packed prefill (:mod:`rollout.fast_prefill`)
    the buckets are attention groups of the one pass; through the HF layers a pass has one bucket."""
    admissions = [a for bucket in buckets for a in bucket]
    width = max(lengths)
    rows = [row for a in admissions for row in a.rows]
    spans, counts = run.layout.spans, run.layout.real_counts
    with run.stage(stages.CACHE_ACQUIRE):
        scratch = run.arena.get(len(admissions), width)
    with run.stage(stages.PREFILL):
        sources = [j for j, a in enumerate(admissions) for _ in a.rows]
        sample_ids = [a.request_id * run.num_samples + s for a in admissions for s in range(a.num_samples)]
        packed = row_data(run, sample_ids, [0] * len(rows), rows, sources,
                          [a.request_id for a in admissions for _ in a.rows],
                          [a.request_id for a in admissions])  # [6, n]
        dst, src, row_prompt = packed[2], packed[3], packed[4]
        prompts = packed[5][:len(admissions)]
        ids = run.prompt_ids[:, -width:].index_select(0, prompts)  # [B_a, W]
        mask = run.prompt_mask[:, -width:].index_select(0, prompts)  # [B_a, W]
        host_rows = ([counts[a.request_id] for a in admissions],
                     [width - spans[a.request_id] for a in admissions])  # first real column in the scratch
        if run.fast_prefill is not None:
            groups, first = [], 0
            for bucket, length in zip(buckets, lengths):
                groups.append((first, first + len(bucket), length))
                first += len(bucket)
            logits = fast_prefill.prefill_logits(*run.fast_prefill, scratch.key_storage[:, :len(admissions)],
                                                 scratch.value_storage[:, :len(admissions)], ids, mask, groups,
                                                 host_rows)  # [B_a, V]
        else:
            logits = prefill_forward(run.model, scratch, ids, mask, width, run.mask_dtype)  # [B_a, V]
        slot = 0
        for bucket, length in zip(buckets, lengths):  # each bucket's own columns only
            num = sum(a.num_samples for a in bucket)
            run.cache.write_prompts(_Columns(scratch, width - length), src[slot:slot + num], dst[slot:slot + num],
                                    mask[:, width - length:])
            slot += num
        if run.seen is not None:  # the original padded prompt row, pad tokens included
            fresh = torch.zeros((len(rows), run.seen.shape[1]), dtype=torch.bool, device=run.seen.device)
            fresh.scatter_(1, run.prompt_ids.index_select(0, row_prompt).long(), True)
            run.seen.index_copy_(0, dst, fresh)
        if run.num_samples > 1:
            logits = logits.index_select(0, src)
        emit(run, dst, logits, packed)
    run.counters["prefill_forwards"] += 1
    run.counters["prefill_rows"] += len(admissions)
    run.counters["prefill_tokens"] += sum(len(b) * n for b, n in zip(buckets, lengths))


class _Columns:
    """A scratch cache seen from column ``start`` on (what ``AlignedKVCache.write_prompts`` reads)."""

    def __init__(self, scratch, start: int):
        self.key_storage = scratch.key_storage[:, :, :, start:]
        self.value_storage = scratch.value_storage[:, :, :, start:]


def _default_stage():
    from instrumentation import stage

    return stage



"""Admissions of the continuous route: make room, plan the admitted prompts' buckets, prefill them into
a scratch cache, copy each bucket's keys/values right-aligned into its slots, select first tokens.

A pass is one bucket through the HF layers; with the packed prefill (``ctx.fast_prefill``) it is the
whole admission wave, whose buckets then only group attention and the KV copies (planned on
``CostModel.packed(copy_kv=True, ...)``). Shared prefill: a prompt with ``n`` samples is one row of its
bucket; its keys/values are copied into its ``n`` slots and its logits repeated, so each sample selects
its own first token. Repetition penalty: each slot's ``seen`` starts from the request's prompt row from its first
real token on (``rollout.ops.sampling.prompt_history``, as the ordinary route and HF ``generate`` count it).
"""

from __future__ import annotations

import torch

from instrumentation import stages
from rollout.executors.continuous.state import RunState, emit, extent, row_data
from rollout.model import hf
from rollout.model.prefill import prefill_logits
from rollout.ops.sampling import prompt_history
from rollout.plan.layout import RowSpans
from rollout.plan.planner import plan_prefill_buckets


def admit(run: RunState, admitted, survivors) -> None:
    """Prefill the requests admitted this step into their slots (after the survivors' decode)."""
    cache, spans, stage = run.cache, run.layout.spans, run.ctx.stage
    need = max(a.prompt_length for a in admitted)
    if not survivors:
        cache.set_front(max(need, run.suffix_max[admitted[0].request_id]))
    elif cache.front < need:
        with stage(stages.CACHE_TRIM):
            cache.realign(len(survivors), max(extent(run, r, 1) for r in survivors), need)
    with stage(stages.PLAN):
        plan = plan_prefill_buckets([a.prompt_length for a in admitted], run.plan_costs, run.ctx.max_prefill_tokens)
    run.stats.plans += 1
    buckets = [[admitted[j] for j in bucket] for bucket in plan.buckets]
    lengths = [max(spans[a.request_id] for a in bucket) for bucket in buckets]
    if run.ctx.fast_prefill is not None:  # one packed pass; the buckets group attention and the KV copies
        _prefill_pass(run, buckets, lengths)
        return
    for bucket, length in zip(buckets, lengths):  # one HF forward per bucket
        _prefill_pass(run, [bucket], [length])


def _prefill_pass(run: RunState, buckets, lengths: list[int]) -> None:
    """One prefill pass over the admitted requests of ``buckets`` (each left-padded to its ``length``)
    into one scratch of the widest bucket's width; then each bucket's columns go into its slots."""
    admissions = [a for bucket in buckets for a in bucket]
    width = max(lengths)
    with run.ctx.stage(stages.CACHE_ACQUIRE):
        scratch = run.arena.get(len(admissions), width)
    with run.ctx.stage(stages.PREFILL):
        packed = _pass_rows(run, admissions)  # [6, n]
        dst, src = packed[2], packed[3]
        prompts = packed[5][:len(admissions)]
        ids = run.prompt_ids[:, -width:].index_select(0, prompts)  # [B_a, W]
        mask = run.prompt_mask[:, -width:].index_select(0, prompts)  # [B_a, W]
        logits = _pass_logits(run, scratch, ids, mask, admissions, (buckets, lengths))  # [B_a, V]
        run.ctx.logit_check.note(logits)
        slot = 0
        for bucket, length in zip(buckets, lengths):  # each bucket's own columns only
            num = sum(a.num_samples for a in bucket)
            run.cache.write_prompts(_Columns(scratch, width - length), src[slot:slot + num], dst[slot:slot + num],
                                    mask[:, width - length:])
            slot += num
        _reset_seen(run, dst, packed[4])
        if run.num_samples > 1:
            logits = logits.index_select(0, src)
        emit(run, dst, logits, packed)
    run.stats.prefill.forwards += 1
    run.stats.prefill.attention_groups += len(buckets)
    run.stats.prefill.rows += len(admissions)
    run.stats.prefill.tokens += sum(len(b) * n for b, n in zip(buckets, lengths))


def _pass_rows(run: RunState, admissions) -> torch.Tensor:
    """``[6, n]`` per admitted slot: sample id, token index 0, slot, scratch row, prompt; row 5 holds the
    admitted prompts (one per scratch row)."""
    slots = [row for a in admissions for row in a.rows]
    sources = [j for j, a in enumerate(admissions) for _ in a.rows]
    sample_ids = [a.request_id * run.num_samples + s for a in admissions for s in range(a.num_samples)]
    return row_data(run, sample_ids, [0] * len(slots), slots, sources,
                    [a.request_id for a in admissions for _ in a.rows], [a.request_id for a in admissions])


def _pass_logits(run: RunState, scratch, ids, mask, admissions, plan) -> torch.Tensor:
    """Last-token logits ``[B_a, V]`` of one pass, its keys/values written into ``scratch``."""
    buckets, lengths = plan
    width = ids.shape[1]
    if run.ctx.fast_prefill is None:
        return hf.prefill_forward(run.ctx.model, scratch, ids, mask, width, run.mask_dtype)
    spans, counts = run.layout.spans, run.layout.real_counts
    rows = RowSpans(tuple(counts[a.request_id] for a in admissions),
                    tuple(width - spans[a.request_id] for a in admissions))  # first real column in the scratch
    groups, first = [], 0
    for bucket, length in zip(buckets, lengths):
        groups.append((first, first + len(bucket), length))
        first += len(bucket)
    num = len(admissions)
    return prefill_logits(run.ctx.fast_prefill, scratch.key_storage[:, :num], scratch.value_storage[:, :num], ids,
                          mask, groups, rows, run.ctx.prefill_graphs)


def _reset_seen(run: RunState, dst: torch.Tensor, row_prompt: torch.Tensor) -> None:
    """The admitted slots' repetition history: their prompt rows from the first real token on (``prompt_history``)."""
    if run.seen is None:
        return
    fresh = torch.zeros((dst.shape[0], run.seen.shape[1]), dtype=torch.bool, device=run.seen.device)
    fresh.scatter_(1, prompt_history(run.prompt_ids.index_select(0, row_prompt),
                                     run.prompt_mask.index_select(0, row_prompt)), True)
    run.seen.index_copy_(0, dst, fresh)


class _Columns:
    """A scratch cache seen from column ``start`` on (what ``AlignedKVCache.write_prompts`` reads)."""

    def __init__(self, scratch, start: int):
        self.key_storage = scratch.key_storage[:, :, :, start:]
        self.value_storage = scratch.value_storage[:, :, :, start:]

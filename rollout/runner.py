"""The ordinary route: one padded batch, our own prefill and decode over a static KV cache.

Each stage is its own function (``prefill``, ``decode_one_token``, ...) so the instrumentation can
wrap it at the call boundary. No ``gc.collect()`` / ``empty_cache()`` here, and at most one host sync
per ``eos_check_interval`` decode steps (the "is anyone still running" check).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from instrumentation import stages
from rollout import compat, fast_prefill, masks
from rollout.config import SamplingConfig
from rollout.kv_cache import StaticKVCache
from rollout.sampling import draw_seed, select_next_token

#: Decides whether another decode step runs (all ranks must agree under ZeRO-3 per-forward gathering).
BusyFn = Callable[[bool], bool]


@dataclass
class DecodeState:
    """Static buffers of one generation, allocated once per call."""

    valid: torch.Tensor  # [N, capacity] bool: which cache columns hold real tokens
    next_pos: torch.Tensor  # [N] position id of the next token fed to the model
    generated: torch.Tensor  # [N, max_new_tokens] raw tokens of every step
    finished: torch.Tensor  # [N] bool: row has produced an EOS
    seen: torch.Tensor | None  # [N, V] bool history for the repetition penalty (None when off)
    seed: torch.Tensor  # scalar int64: keys the sampling noise (see rollout.sampling)
    rows: torch.Tensor  # [N] int64: each row's sample id
    mask_dtype: torch.dtype = torch.bool  # what compat.to_model_mask needs for this model (read once)
    num_steps: int = 0  # tokens produced so far (prefill produces the first)
    counters: dict = field(default_factory=lambda: {"prefill_forwards": 0, "decode_forwards": 0})


def init_state(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: SamplingConfig,
               capacity: int, vocab_size: int, buffers=None, sample_ids: torch.Tensor | None = None) -> DecodeState:
    """The call's decode state; views into ``buffers`` (a ``DecodeBuffers``) when the fast decoder runs."""
    num_rows = prompt_ids.shape[0]
    device = prompt_ids.device
    use_seen = sampling.repetition_penalty != 1.0
    if buffers is None:
        state = DecodeState(
            valid=masks.key_validity(prompt_mask, capacity),
            next_pos=prompt_mask.long().sum(dim=1),
            generated=torch.zeros((num_rows, sampling.max_new_tokens), dtype=torch.long, device=device),
            finished=torch.zeros(num_rows, dtype=torch.bool, device=device),
            # seen: [N, V] — the padded history, padding included (HF semantics)
            seen=torch.zeros((num_rows, vocab_size), dtype=torch.bool, device=device) if use_seen else None,
            seed=torch.full((), draw_seed(sampling), dtype=torch.long, device=device),
            rows=torch.arange(num_rows, dtype=torch.long, device=device) if sample_ids is None else sample_ids,
        )
    else:
        buffers.valid.fill_(True)
        buffers.valid[:num_rows, :prompt_ids.shape[1]] = prompt_mask.bool()
        buffers.finished.zero_()
        buffers.seed.fill_(draw_seed(sampling))
        if sample_ids is not None:
            buffers.rows[:num_rows] = sample_ids
        else:
            buffers.rows.copy_(torch.arange(buffers.rows.shape[0], device=device))
        if use_seen:
            buffers.seen.zero_()
        state = DecodeState(valid=buffers.valid[:num_rows, :capacity], next_pos=prompt_mask.long().sum(dim=1),
                            generated=buffers.generated[:num_rows, :sampling.max_new_tokens],
                            finished=buffers.finished[:num_rows],
                            seen=buffers.seen[:num_rows] if use_seen else None, seed=buffers.seed,
                            rows=buffers.rows[:num_rows])
    if state.seen is not None:
        state.seen.scatter_(1, prompt_ids.long(), True)
    return state


def _emit(state: DecodeState, logits: torch.Tensor, sampling: SamplingConfig, eos_ids: torch.Tensor | None):
    step = torch.full((), state.num_steps, dtype=torch.long, device=logits.device)  # a fill, no host->device copy
    tokens = select_next_token(logits, sampling, state.seen, state.seed, state.rows, step)  # [N]
    state.generated[:, state.num_steps] = tokens
    if state.seen is not None:
        state.seen.scatter_(1, tokens[:, None], True)
    if eos_ids is not None:
        state.finished |= torch.isin(tokens, eos_ids)
    state.num_steps += 1
    return tokens


def prefill_forward(model, cache: StaticKVCache, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                    prompt_len: int, mask_dtype: torch.dtype) -> torch.Tensor:
    """One HF forward writing ``prompt_ids [b, L]`` into prompt columns ``[T_p - L, T_p)`` of ``cache``'s
    rows; returns the last position's logits ``[b, V]``. Earlier columns of these rows must be padding.
    (Our own prefill is :func:`rollout.fast_prefill.prefill_logits`.)"""
    length = prompt_ids.shape[1]
    start = prompt_len - length
    cache.set_window(torch.arange(start, start + length, device=prompt_ids.device), start + length)
    keep = masks.prefill_mask(prompt_mask)
    if start:  # the padding columns [0, start) are never attended: zero them so stale values cannot leak
        cache.key_storage[:, :, :, :start].zero_()
        cache.value_storage[:, :, :, :start].zero_()
        keep = torch.cat([keep.new_zeros(keep.shape[:3] + (start,)), keep], dim=-1)
    mask = compat.to_model_mask(keep, model, mask_dtype)
    return compat.forward_last_logits(model, prompt_ids, masks.prompt_positions(prompt_mask), mask, cache)


def prefill(model, cache: StaticKVCache, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
            state: DecodeState, sampling: SamplingConfig, eos_ids: torch.Tensor | None,
            buckets: list[tuple[int, int, int]] | None = None, fast: tuple | None = None,
            host_rows: tuple | None = None) -> torch.Tensor:
    """Write the prompts into cache columns ``[0, T_p)`` and produce the first token of every row.

    ``buckets``: ``(first_row, stop_row, length)`` per prefill forward (rows sorted so each bucket is
    contiguous; ``length`` covers every real token of its rows); None is one forward over all rows.
    ``fast`` (``(spec, weights, step fns)``): our own prefill, one packed pass over the weights for all
    buckets, attention per bucket.
    """
    prompt_len = prompt_ids.shape[1]
    if fast is not None:
        rows = prompt_ids.shape[0]
        logits = fast_prefill.prefill_logits(*fast, cache.key_storage[:, :rows], cache.value_storage[:, :rows],
                                             prompt_ids, prompt_mask, buckets, host_rows)
        state.counters["prefill_forwards"] += 1
        state.counters["prefill_attention_groups"] = len(buckets or [None])
        return _emit(state, logits, sampling, eos_ids)
    logits = []
    for first, stop, length in buckets or [(0, prompt_ids.shape[0], prompt_len)]:
        cols = slice(prompt_len - length, prompt_len)
        logits.append(prefill_forward(model, cache.rows(first, stop) if buckets else cache,
                                      prompt_ids[first:stop, cols], prompt_mask[first:stop, cols], prompt_len, state.mask_dtype))
        state.counters["prefill_forwards"] += 1
    return _emit(state, logits[0] if len(logits) == 1 else torch.cat(logits), sampling, eos_ids)


def decode_one_token(model, cache: StaticKVCache, tokens: torch.Tensor, prompt_len: int, state: DecodeState,
                     sampling: SamplingConfig, eos_ids: torch.Tensor | None) -> torch.Tensor:
    """Feed the last tokens (column ``T_p + k - 1``) and produce token ``k`` of every row."""
    col = prompt_len + state.num_steps - 1
    cache.set_window(torch.full((1,), col, dtype=torch.long, device=tokens.device), col + 1)
    mask = compat.to_model_mask(masks.decode_mask(state.valid, col + 1), model, state.mask_dtype)
    positions = (state.next_pos + (state.num_steps - 1))[:, None]  # [N, 1]
    logits = compat.forward_last_logits(model, tokens[:, None], positions, mask, cache)
    state.counters["decode_forwards"] += 1
    return _emit(state, logits, sampling, eos_ids)


def generate_ordinary(model, cache: StaticKVCache, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                      sampling: SamplingConfig, eos_ids: torch.Tensor | None, vocab_size: int,
                      eos_check_interval: int, busy: BusyFn, stage=None, decoder=None,
                      eos_key: tuple = (), buckets: list[list[int]] | None = None,
                      bucket_lengths: list[int] | None = None, fast_prefill: tuple | None = None,
                      host_rows: tuple | None = None) -> DecodeState:
    """Prefill then decode until every row has finished (EOS) or the budget is spent.

    ``busy(local_busy)`` returns whether any rank still runs; every rank calls it at the same steps, so
    all ranks run the same number of forwards. ``stage(name)`` (a context-manager factory) wraps
    each prefill/decode call when given. ``decoder`` (a ``FastDecoder``) runs the decode steps through
    our own step function (and CUDA graphs on GPU); None runs them through the HF model.

    ``buckets`` (lists of row indices, from the prefill planner) prefill each group in its own forward,
    padded only to the group's longest prompt (``bucket_lengths``). Rows are then generated in bucket
    order and put back in request order at the end; each keeps its sample id, so sampling is unchanged.
    ``fast_prefill`` (``(spec, weights, step fns)``) runs the prefill through :mod:`rollout.fast_prefill`:
    one packed pass over the weights, attention per bucket; ``host_rows`` (real-token counts and first
    real columns per row, request order, host ints) spares it a host sync.
    """
    stage = stage or _no_stage
    capacity = cache.shape.capacity
    num_rows, prompt_len = prompt_ids.shape
    order = sample_ids = spans = None
    if buckets is not None and len(buckets) > 1:
        order = torch.tensor([row for bucket in buckets for row in bucket], device=prompt_ids.device)
        prompt_ids, prompt_mask, sample_ids = prompt_ids[order], prompt_mask[order], order
        sizes = [len(b) for b in buckets]
        firsts = [sum(sizes[:k]) for k in range(len(sizes))]
        spans = [(f, f + n, length) for f, n, length in zip(firsts, sizes, bucket_lengths)]
        if host_rows is not None:
            rows = [row for bucket in buckets for row in bucket]
            host_rows = tuple([values[row] for row in rows] for values in host_rows)
    buffers = None
    if decoder is not None:
        buffers = decoder.buffers_for(num_rows, capacity, sampling.max_new_tokens, vocab_size, prompt_ids.device)
    state = init_state(prompt_ids, prompt_mask, sampling, capacity, vocab_size, buffers, sample_ids)
    state.mask_dtype = compat.mask_dtype(model)
    with stage(stages.PREFILL):
        tokens = prefill(model, cache, prompt_ids, prompt_mask, state, sampling, eos_ids, spans, fast_prefill,
                         host_rows)
    step = None
    if decoder is not None:
        buffers.tokens[:num_rows] = tokens
        buffers.positions[:num_rows] = state.next_pos
        buffers.col.fill_(prompt_len)
        buffers.step.fill_(1)
        step = decoder.stepper(cache, num_rows, sampling, eos_ids, eos_key, state.seen is not None)
    while state.num_steps < sampling.max_new_tokens:
        if eos_ids is not None and state.num_steps % eos_check_interval == 0:
            if not busy(not bool(state.finished.all())):
                break
        with stage(stages.DECODE):
            if step is None:
                tokens = decode_one_token(model, cache, tokens, prompt_len, state, sampling, eos_ids)
            else:
                mode = step(prompt_len + state.num_steps)  # "graph" or "eager"
                state.counters[f"{mode}_decode_steps"] = state.counters.get(f"{mode}_decode_steps", 0) + 1
                state.num_steps += 1
                state.counters["decode_forwards"] += 1
    if order is not None:  # back to request order
        state.generated = state.generated.index_select(0, torch.argsort(order))
    return state


class _NoStage:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


_NO_STAGE = _NoStage()


def _no_stage(name):
    return _NO_STAGE

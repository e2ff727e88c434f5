"""Per-call state of the continuous-batching route and the per-row operations on it.

The host keeps the bookkeeping (the scheduler's rows, prompt spans); the device keeps what the
forwards read and write: each slot's newest token, its repetition history and the output buffer.
Per-row data a step needs on the device (sample ids, token indices, positions, row maps) goes in
one host-to-device copy (pinned and non-blocking on CUDA: no host sync).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from rollout.cache.aligned import AlignedKVCache
from rollout.cache.pool import ScratchArena
from rollout.executors.context import CallContext
from rollout.executors.continuous.buffers import CBBuffers
from rollout.model import compat
from rollout.model.prefill import varlen_attention
from rollout.ops.host import to_device
from rollout.ops.sampling import draw_seed
from rollout.plan.layout import PromptLayout
from rollout.plan.planner import CostModel
from rollout.stats import CallStats


@dataclass(frozen=True)
class GraphDecode:
    """Decode from the executor's static buffers (replayed from CUDA graphs on the GPU)."""

    buffers: CBBuffers
    step: Callable[[int, int, int], str]
    """``step(num_rows, front, read_start) -> "graph" | "eager"`` (``cache.begin_decode`` already ran and
    the rows' data is in ``buffers.rowdata``)."""


@dataclass
class RunState:
    """Per-call state: host bookkeeping plus the device buffers the loop updates in place."""

    ctx: CallContext
    cache: AlignedKVCache
    arena: ScratchArena
    prompt_ids: torch.Tensor  # [B, T_p] left-padded, as requested
    prompt_mask: torch.Tensor  # [B, T_p]
    layout: PromptLayout
    suffix_max: list  # suffix_max[p]: longest span among prompts p.. (FIFO order)
    seen: Optional[torch.Tensor]  # [num_slots, V] bool repetition history per slot
    last_tokens: torch.Tensor  # [num_slots] newest token per slot (the next decode input)
    generated: torch.Tensor  # [B*n, max_new_tokens]
    logprobs: Optional[torch.Tensor]  # [B*n, max_new_tokens] fp32 (SamplingConfig.return_logprobs), else None
    seed: torch.Tensor  # scalar int64 keying the sampling noise
    stats: CallStats
    mask_dtype: torch.dtype
    plan_costs: CostModel  # what admissions are planned on (the packed view with the packed prefill)
    graph: Optional[GraphDecode] = None
    width: int = 0
    done: Optional[torch.Tensor] = None
    """``[num_slots]`` bool: whether each slot's row has emitted an EOS id, kept on the device between the
    EOS checks when they are ``eos_check_interval > 1`` steps apart (None otherwise: each check reads
    the newest tokens)."""

    @property
    def num_samples(self) -> int:
        return self.ctx.sampling.n_samples_per_prompt


def new_run_state(ctx: CallContext, cache: AlignedKVCache, arena: ScratchArena, prompt_ids, prompt_mask,
                  layout: PromptLayout, graph: Optional[GraphDecode]) -> RunState:
    """The call's state; with ``graph`` its tensors are the static buffers (fills only: their addresses
    are what the captured graphs read)."""
    device, num_slots, sampling = cache.valid.device, cache.num_slots, ctx.sampling
    suffix_max = list(layout.spans)
    for p in range(len(suffix_max) - 2, -1, -1):
        suffix_max[p] = max(suffix_max[p], suffix_max[p + 1])
    use_seen = sampling.repetition_penalty != 1.0
    seed = 0 if sampling.is_greedy else draw_seed(sampling)
    if graph is None:
        num_rows = layout.num_prompts * sampling.n_samples_per_prompt
        seen = torch.zeros((num_slots, ctx.vocab_size), dtype=torch.bool, device=device) if use_seen else None
        last_tokens = torch.zeros(num_slots, dtype=torch.long, device=device)  # last_tokens: [S]
        generated = torch.zeros((num_rows, sampling.max_new_tokens), dtype=torch.long, device=device)  # [B*n, T_r]
        logprobs = torch.zeros(generated.shape, device=device) if ctx.with_logprobs else None
        seed_t = torch.full((), seed, dtype=torch.long, device=device)  # a fill, not a host->device copy
    else:
        seen, last_tokens, generated, seed_t = graph.buffers.start(seed, use_seen)
        logprobs = graph.buffers.logprobs if ctx.with_logprobs else None
    done = (torch.zeros(num_slots, dtype=torch.bool, device=device)
            if ctx.eos.tensor is not None and ctx.eos_check_interval > 1 else None)
    return RunState(ctx, cache, arena, prompt_ids, prompt_mask, layout, suffix_max, seen, last_tokens, generated,
                    logprobs, seed_t, CallStats(route="continuous"), compat.mask_dtype(ctx.model),
                    _plan_costs(ctx, device), graph, done=done)


def _plan_costs(ctx: CallContext, device) -> CostModel:
    """Admissions prefill in one packed pass with the packed prefill: their buckets then only group
    attention (none with variable-length attention) and the copies into the cache."""
    if ctx.fast_prefill is None:
        return ctx.cost_model
    varlen = varlen_attention(device, ctx.fast_prefill.weights.embed.dtype) is not None
    return ctx.cost_model.packed(copy_kv=True, varlen=varlen)


def extent(run: RunState, row, fed_this_step: int = 0) -> int:
    """Columns a live row uses: its span plus the tokens it has fed back (all produced but the newest)."""
    return run.layout.spans[row.request_id] + row.num_generated - 1 + fed_this_step


def record_cache(stats: CallStats, cache: AlignedKVCache, arena: ScratchArena) -> None:
    """The aligned cache's own counters become the call's (one record, no copies), with its size and the scratch
    arena's."""
    stats.cache = cache.stats
    stats.cache.capacity, stats.cache.num_slots, stats.cache.nbytes = cache.capacity, cache.num_slots, cache.nbytes
    stats.cache.scratch_bytes, stats.cache.scratch_allocations = arena.nbytes, arena.num_allocations


def row_data(run: RunState, sample_ids, steps, *extra) -> torch.Tensor:
    """One host->device copy of per-row data, ``packed [2 + len(extra), n]`` int64: sample ids (the
    row in the expanded output), token indices, then the ``extra`` rows (a shorter one is zero-padded)."""
    host = np.zeros((2 + len(extra), len(sample_ids)), dtype=np.int64)
    host[0] = sample_ids
    host[1] = steps
    for k, values in enumerate(extra):
        host[2 + k, :len(values)] = values
    return to_device(host, run.last_tokens.device)


def emit(run: RunState, rows, logits: torch.Tensor, packed: torch.Tensor) -> None:
    """Select each row's next token and record it. ``rows``: a slice of slots or a slot index tensor;
    ``packed``: ``row_data`` of these rows (sample ids and token indices key the sampling noise)."""
    is_slice = isinstance(rows, slice)
    seen = None if run.seen is None else (run.seen[rows] if is_slice else run.seen.index_select(0, rows))
    tokens, logprobs = run.ctx.sampler(logits, seen, run.seed, packed[0], packed[1], run.ctx.with_logprobs)  # [n]
    if logprobs is not None:
        run.logprobs.index_put_((packed[0], packed[1]), logprobs)
    if is_slice:
        run.last_tokens[rows] = tokens
        if seen is not None:
            seen.scatter_(1, tokens[:, None], True)  # seen is a view of run.seen
    else:
        run.last_tokens.index_copy_(0, rows, tokens)
        if seen is not None:
            run.seen.index_put_((rows, tokens), torch.ones((), dtype=torch.bool, device=tokens.device))
    run.generated.index_put_((packed[0], packed[1]), tokens)


def mark_done(run: RunState, num_survivors: int, num_live: int) -> None:
    """With EOS checks ``eos_check_interval > 1`` steps apart: fold the live rows' newest tokens into
    their sticky EOS flags, on the device (no sync); admitted slots ``[num_survivors, num_live)`` start
    clear."""
    if run.done is None:
        return
    run.done[num_survivors:num_live] = False
    run.done[:num_live] |= torch.isin(run.last_tokens[:num_live], run.ctx.eos.tensor)


def finished_flags(run: RunState, num_live: int, check: bool = True):
    """Whether each live row has ended at an EOS id: at a check, one host sync (the step's only one);
    between checks (``check=False``) or without EOS ids, all False (rows then end at the budget or at
    a later check; the tokens a row decodes after its EOS are masked in the output)."""
    if run.ctx.eos.tensor is None or not check:
        return (False,) * num_live
    run.stats.decode.host_syncs += 1
    if run.done is not None:
        return run.done[:num_live].tolist()
    return torch.isin(run.last_tokens[:num_live], run.ctx.eos.tensor).tolist()

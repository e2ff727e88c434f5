"""Per-call state of the continuous-batching route and the per-row operations on it.

The host keeps the bookkeeping (the scheduler's rows, prompt spans); the device keeps what the
forwards read and write: each slot's newest token, its repetition history and the output buffer.
Per-row data a step needs on the device (sample ids, token indices, positions, row maps) goes in
one host-to-device copy (pinned and non-blocking on CUDA: no host sync).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rollout import compat
from rollout.aligned_cache import AlignedKVCache, ScratchArena, to_device
from rollout.cb_route import PromptLayout
from rollout.config import SamplingConfig
from rollout.planner import CostModel
from rollout.sampling import draw_seed, select_next_token

COUNTERS = ("steps", "host_syncs", "plans", "prefill_forwards", "prefill_rows", "prefill_tokens",
            "decode_forwards", "decode_rows")


@dataclass
class RunState:
    """Per-call state: host bookkeeping plus the device buffers the loop updates in place."""

    model: torch.nn.Module
    cache: AlignedKVCache
    arena: ScratchArena
    sampling: SamplingConfig
    eos_ids: torch.Tensor | None
    cost_model: CostModel
    max_prefill_tokens: int | None
    stage: object
    prompt_ids: torch.Tensor  # [B, T_p] left-padded, as requested
    prompt_mask: torch.Tensor  # [B, T_p]
    layout: PromptLayout
    suffix_max: list  # suffix_max[p]: longest span among prompts p.. (FIFO order)
    seen: torch.Tensor | None  # [num_slots, V] bool repetition history per slot
    last_tokens: torch.Tensor  # [num_slots] newest token per slot (the next decode input)
    generated: torch.Tensor  # [B*n, max_new_tokens]
    seed: torch.Tensor  # scalar int64 keying the sampling noise
    counters: dict
    mask_dtype: torch.dtype
    fast: tuple | None = None  # (spec, weights, step fns) of rollout.fast_decode, or None: HF layers decode
    fast_prefill: tuple | None = None  # the same parts for rollout.fast_prefill, or None: HF layers prefill
    graph: tuple | None = None  # (step, CBBuffers) of rollout.cb_graphs: decode from static buffers
    plan_costs: CostModel | None = None  # what admissions are planned on (the packed view with fast_prefill)
    width: int = 0

    @property
    def num_samples(self) -> int:
        return self.sampling.n_samples_per_prompt


def check_args(prompt_ids, prompt_mask, sampling, eos_ids, cost_model) -> None:
    if not isinstance(sampling, SamplingConfig):
        raise ValueError(f"sampling: must be a SamplingConfig; got {type(sampling).__name__}")
    if not isinstance(cost_model, CostModel):
        raise ValueError(f"cost_model: must be a planner.CostModel; got {type(cost_model).__name__}")
    if not isinstance(prompt_ids, torch.Tensor) or prompt_ids.dim() != 2:
        raise ValueError("prompt_ids: must be a 2-D tensor [B, T_p]")
    if not isinstance(prompt_mask, torch.Tensor) or prompt_mask.shape != prompt_ids.shape:
        raise ValueError(f"prompt_mask: must be a tensor of prompt_ids' shape {tuple(prompt_ids.shape)}")
    if eos_ids is not None and (not isinstance(eos_ids, torch.Tensor) or eos_ids.dim() != 1):
        raise ValueError("eos_ids: must be None or a 1-D tensor of token ids")


def new_run_state(model, cache: AlignedKVCache, arena: ScratchArena, sampling: SamplingConfig, eos_ids,
                  cost_model: CostModel, max_prefill_tokens, stage, prompt_ids, prompt_mask, layout: PromptLayout,
                  counters: dict, fast: tuple | None = None, fast_prefill: tuple | None = None,
                  graph: tuple | None = None) -> RunState:
    """The call's state; with ``graph`` (``(step, CBBuffers)``) its tensors are the static buffers."""
    device, num_slots = cache.valid.device, cache.num_slots
    spans = layout.spans
    suffix_max = list(spans)
    for p in range(len(spans) - 2, -1, -1):
        suffix_max[p] = max(spans[p], suffix_max[p + 1])
    use_seen = sampling.repetition_penalty != 1.0
    num_rows = len(spans) * sampling.n_samples_per_prompt
    seed = 0 if sampling.is_greedy else draw_seed(sampling)
    if graph is None:
        seen = torch.zeros((num_slots, model.config.vocab_size), dtype=torch.bool, device=device) \
            if use_seen else None  # seen: [S, V]
        last_tokens = torch.zeros(num_slots, dtype=torch.long, device=device)  # last_tokens: [S]
        generated = torch.zeros((num_rows, sampling.max_new_tokens), dtype=torch.long, device=device)  # [B*n, T_r]
        seed_t = torch.full((), seed, dtype=torch.long, device=device)  # a fill, not a host->device copy
    else:  # the static buffers: fills only (their addresses are what the captured graphs read)
        bufs = graph[1]
        seen = bufs.seen if use_seen else None
        if seen is not None:
            seen.zero_()
        last_tokens = bufs.last_tokens
        last_tokens.zero_()
        generated = bufs.generated  # [>= B*n + 1, >= T_r]: the last row is the padding slots' sink
        generated.zero_()
        seed_t = bufs.seed
        seed_t.fill_(seed)
    return RunState(
        model=model, cache=cache, arena=arena, sampling=sampling, eos_ids=eos_ids, cost_model=cost_model,
        max_prefill_tokens=max_prefill_tokens, stage=stage, prompt_ids=prompt_ids, prompt_mask=prompt_mask,
        layout=layout, suffix_max=suffix_max, seen=seen, last_tokens=last_tokens, generated=generated,
        seed=seed_t, counters=counters, mask_dtype=compat.mask_dtype(model), fast=fast, fast_prefill=fast_prefill,
        graph=graph, plan_costs=_plan_costs(cost_model, fast_prefill, device))


def _plan_costs(cost_model: CostModel, fast_prefill: tuple | None, device) -> CostModel:
    """Admissions prefill in one packed pass when ``fast_prefill`` is given: their buckets then only group
    attention (none with variable-length attention) and the copies into the cache."""
    if fast_prefill is None:
        return cost_model
    from rollout.fast_prefill import varlen_attention

    varlen = varlen_attention(device, fast_prefill[1].embed.dtype) is not None
    return cost_model.packed(copy_kv=True, varlen=varlen)


def cache_counters(cache: AlignedKVCache) -> dict:
    stats = cache.stats
    return {"trims": stats.num_trims, "shifts": stats.num_shifts, "row_moves": stats.num_row_moves,
            "bytes_moved": stats.move_bytes, "prefill_copy_bytes": stats.prefill_copy_bytes,
            "capacity": cache.capacity, "num_slots": cache.num_slots, "cache_bytes": cache.nbytes}


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
    tokens = select_next_token(logits, run.sampling, seen, run.seed, packed[0], packed[1])  # [n]
    if is_slice:
        run.last_tokens[rows] = tokens
        if seen is not None:
            seen.scatter_(1, tokens[:, None], True)  # seen is a view of run.seen
    else:
        run.last_tokens.index_copy_(0, rows, tokens)
        if seen is not None:
            run.seen.index_put_((rows, tokens), torch.ones((), dtype=torch.bool, device=tokens.device))
    run.generated.index_put_((packed[0], packed[1]), tokens)


def finished_flags(run: RunState, num_live: int):
    """EOS flag of every live row's newest token: the step's one host sync (none without EOS ids)."""
    if run.eos_ids is None:
        return (False,) * num_live
    run.counters["host_syncs"] += 1
    return torch.isin(run.last_tokens[:num_live], run.eos_ids).tolist()

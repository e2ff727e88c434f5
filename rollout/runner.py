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
from rollout import compat, masks
from rollout.config import SamplingConfig
from rollout.kv_cache import StaticKVCache
from rollout.sampling import make_generator, select_next_token

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
    generator: torch.Generator | None
    num_steps: int = 0  # tokens produced so far (prefill produces the first)
    counters: dict = field(default_factory=lambda: {"prefill_forwards": 0, "decode_forwards": 0})


def init_state(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: SamplingConfig,
               capacity: int, vocab_size: int) -> DecodeState:
    num_rows = prompt_ids.shape[0]
    device = prompt_ids.device
    seen = None
    if sampling.repetition_penalty != 1.0:
        # seen: [N, V] — the padded history, padding included (HF semantics)
        seen = torch.zeros((num_rows, vocab_size), dtype=torch.bool, device=device)
        seen.scatter_(1, prompt_ids.long(), True)
    return DecodeState(
        valid=masks.key_validity(prompt_mask, capacity),
        next_pos=prompt_mask.long().sum(dim=1),
        generated=torch.zeros((num_rows, sampling.max_new_tokens), dtype=torch.long, device=device),
        finished=torch.zeros(num_rows, dtype=torch.bool, device=device),
        seen=seen,
        generator=make_generator(sampling, device),
    )


def _emit(state: DecodeState, logits: torch.Tensor, sampling: SamplingConfig, eos_ids: torch.Tensor | None):
    tokens = select_next_token(logits, sampling, state.seen, state.generator)  # [N]
    state.generated[:, state.num_steps] = tokens
    if state.seen is not None:
        state.seen.scatter_(1, tokens[:, None], True)
    if eos_ids is not None:
        state.finished |= torch.isin(tokens, eos_ids)
    state.num_steps += 1
    return tokens


def prefill(model, cache: StaticKVCache, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
            state: DecodeState, sampling: SamplingConfig, eos_ids: torch.Tensor | None) -> torch.Tensor:
    """Write the prompts into cache columns ``[0, T_p)`` and produce the first token of every row."""
    prompt_len = prompt_ids.shape[1]
    cache.set_window(torch.arange(prompt_len, device=prompt_ids.device), prompt_len)
    mask = compat.to_model_mask(masks.prefill_mask(prompt_mask), model, _mask_dtype(model))
    logits = compat.forward_last_logits(model, prompt_ids, masks.prompt_positions(prompt_mask), mask, cache)
    state.counters["prefill_forwards"] += 1
    return _emit(state, logits, sampling, eos_ids)


def decode_one_token(model, cache: StaticKVCache, tokens: torch.Tensor, prompt_len: int, state: DecodeState,
                     sampling: SamplingConfig, eos_ids: torch.Tensor | None) -> torch.Tensor:
    """Feed the last tokens (column ``T_p + k - 1``) and produce token ``k`` of every row."""
    col = prompt_len + state.num_steps - 1
    cache.set_window(torch.full((1,), col, dtype=torch.long, device=tokens.device), col + 1)
    mask = compat.to_model_mask(masks.decode_mask(state.valid, col + 1), model, _mask_dtype(model))
    positions = (state.next_pos + (state.num_steps - 1))[:, None]  # [N, 1]
    logits = compat.forward_last_logits(model, tokens[:, None], positions, mask, cache)
    state.counters["decode_forwards"] += 1
    return _emit(state, logits, sampling, eos_ids)


def generate_ordinary(model, cache: StaticKVCache, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                      sampling: SamplingConfig, eos_ids: torch.Tensor | None, vocab_size: int,
                      eos_check_interval: int, busy: BusyFn, stage=None) -> DecodeState:
    """Prefill then decode until every row has finished (EOS) or the budget is spent.

    ``busy(local_busy)`` returns whether any rank still runs; every rank calls it at the same steps, so
    all ranks run the same number of forwards. ``stage(name)`` (a context-manager factory) wraps
    each prefill/decode call when given.
    """
    stage = stage or _no_stage
    capacity = cache.shape.capacity
    state = init_state(prompt_ids, prompt_mask, sampling, capacity, vocab_size)
    prompt_len = prompt_ids.shape[1]
    with stage(stages.PREFILL):
        tokens = prefill(model, cache, prompt_ids, prompt_mask, state, sampling, eos_ids)
    while state.num_steps < sampling.max_new_tokens:
        if eos_ids is not None and state.num_steps % eos_check_interval == 0:
            if not busy(not bool(state.finished.all())):
                break
        with stage(stages.DECODE):
            tokens = decode_one_token(model, cache, tokens, prompt_len, state, sampling, eos_ids)
    return state


def _mask_dtype(model) -> torch.dtype:
    return next(model.parameters()).dtype if compat.attention_implementation(model) == "eager" else torch.bool


class _NoStage:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


_NO_STAGE = _NoStage()


def _no_stage(name):
    return _NO_STAGE

"""The ordinary route's static decode buffers and the step captured over them.

The buffers (tokens, positions, cache column, step, validity mask, generated tokens, finished flags,
repetition history) are allocated once per shape and reused across calls; the per-call decode state
is made of views into them, so captured graphs stay valid. A live batch of ``n`` rows runs in the
batch bucket ``b >= n`` (padding rows compute values nobody reads); attention reads only the first
``length_bucket`` cache columns. ``generated`` is indexed by sample id, so ``compact`` can move rows.
"""

from __future__ import annotations

from typing import Optional

import torch

from rollout.model.step import StepParts, decode_logits
from rollout.executors.decode import shares_prefix
from rollout.ops.decode_attention import SharedPrefix
from rollout.ops.sampling import Sampler


class DecodeBuffers:
    """Persistent static tensors of the decode loop, sized for ``max_rows`` x ``capacity``."""

    def __init__(self, max_rows: int, capacity: int, max_new_tokens: int, vocab_size: int, device):
        self.shape = (max_rows, capacity, max_new_tokens, vocab_size, torch.device(device))
        long = dict(dtype=torch.long, device=device)
        self.tokens = torch.zeros(max_rows, **long)
        self.positions = torch.zeros(max_rows, **long)
        self.col = torch.zeros((), **long)
        self.step = torch.zeros((), **long)
        self.seed = torch.zeros((), **long)
        self.prefix_end = torch.zeros((), **long)
        self.rows = torch.arange(max_rows, **long)
        self.cols = torch.arange(capacity, **long)
        self.valid = torch.ones((max_rows, capacity), dtype=torch.bool, device=device)
        self.generated = torch.zeros((max_rows, max_new_tokens), **long)
        self.logprobs = torch.zeros((max_rows, max_new_tokens), dtype=torch.float32, device=device)
        self.finished = torch.zeros(max_rows, dtype=torch.bool, device=device)
        self.budgets = torch.full((max_rows,), max_new_tokens, **long)  # by sample id (read, never written by a step)
        self.seen = torch.zeros((max_rows, vocab_size), dtype=torch.bool, device=device)

    def fits(self, rows: int, capacity: int, max_new_tokens: int, vocab_size: int, device) -> bool:
        max_rows, cap, max_new, vocab, dev = self.shape
        return rows <= max_rows and capacity <= cap and max_new_tokens <= max_new and vocab == vocab_size \
            and dev == torch.device(device)

    def reset(self, prompt_mask: torch.Tensor, seed: int, sample_ids: torch.Tensor, use_seen: bool,
              budgets: Optional[torch.Tensor] = None) -> None:
        """Start a call: validity from the prompt mask, the seed, each row's sample id (the padding rows of
        the batch bucket get ids past the real ones, so their tokens land in rows nobody reads), no real
        row finished (the padding rows count as finished: they are never waited for), the rows' own budgets
        by sample id (``[N]``; None: none)."""
        num_rows, prompt_len = prompt_mask.shape
        self.valid.fill_(True)
        self.valid[:num_rows, :prompt_len] = prompt_mask.bool()
        self.finished.zero_()
        self.finished[num_rows:] = True
        self.seed.fill_(seed)
        self.rows.copy_(torch.arange(self.rows.shape[0], device=self.rows.device))
        self.rows[:num_rows] = sample_ids
        self.generated.zero_()
        self.budgets.fill_(self.generated.shape[1])
        if budgets is not None:
            self.budgets[:budgets.shape[0]] = budgets
        if use_seen:
            self.seen.zero_()

    def start(self, tokens: torch.Tensor, positions: torch.Tensor, prompt_len: int) -> None:
        """After prefill: the first tokens, their positions, decode from column ``T_p``, token index 1 (the
        prompts' columns, shared by each prompt's samples, end at ``T_p``)."""
        num_rows = tokens.shape[0]
        self.tokens[:num_rows] = tokens
        self.positions[:num_rows] = positions
        self.col.fill_(prompt_len)
        self.prefix_end.fill_(prompt_len)
        self.step.fill_(1)

    def compact(self, cache, bucket: int, new_bucket: int, num_cols: int) -> int:
        """Move the unfinished rows of ``[0, bucket)`` to the front (keeping their order) and return
        ``new_bucket``, the rows later steps compute; every per-row buffer and the cache's first
        ``num_cols`` columns follow. On the device, no host sync."""
        keep = torch.argsort(self.finished[:bucket].to(torch.int8), stable=True)[:new_bucket]
        for tensor in (self.tokens, self.positions, self.finished, self.rows, self.valid, self.seen):
            tensor[:new_bucket] = tensor.index_select(0, keep)
        for storage in (cache.key_storage, cache.value_storage):
            for layer in range(storage.shape[0]):  # one layer at a time bounds the temporary
                block = storage[layer, :, :, :num_cols]
                block[:new_bucket] = block.index_select(0, keep)
        return new_bucket

    def mutable(self) -> list[torch.Tensor]:
        """What one step writes (saved and restored around a capture's warm-up runs)."""
        return [self.tokens, self.positions, self.col, self.step, self.finished, self.seen, self.generated,
                self.logprobs]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in vars(self).values() if isinstance(t, torch.Tensor))


def decode_step(parts: StepParts, cache, bufs: DecodeBuffers, shape: tuple[int, int], sampler: Sampler,
                eos_ids: Optional[torch.Tensor], *, has_seen: bool, with_logprobs: bool = False,
                samples: int = 1, first_row: bool = False, budgets: bool = False) -> None:
    """The captured work of one step over ``shape = (batch bucket, length bucket)``: logits, token choice,
    and every buffer update (no host sync). The attention reads no column past the current one (masked for
    every row) and, where :func:`shares_prefix`, each prompt's columns once for its ``samples`` rows (``first_row``:
    each row from its run's first row, ``SharedPrefix.first_row``)."""
    bucket, length = shape
    keep = (bufs.valid[:bucket, :length] & (bufs.cols[:length] <= bufs.col))[:, None, None, :]
    shared = None
    if shares_prefix(parts, bucket, samples, first_row):
        shared = SharedPrefix(bufs.rows[:bucket], samples, bufs.prefix_end, first_row)
    logits = decode_logits(parts, cache.key_storage[:, :bucket], cache.value_storage[:, :bucket],
                           bufs.tokens[:bucket], bufs.positions[:bucket], bufs.col, keep, last=bufs.col, shared=shared)
    seen = bufs.seen[:bucket] if has_seen else None
    rows = bufs.rows[:bucket]  # sample ids: generated is in request order whatever the rows' positions
    tokens, logprobs = sampler(logits, seen, bufs.seed, rows, bufs.step, with_logprobs)
    bufs.generated.index_put_((rows, bufs.step.expand_as(rows)), tokens)
    if logprobs is not None:
        bufs.logprobs.index_put_((rows, bufs.step.expand_as(rows)), logprobs)
    bufs.tokens[:bucket].copy_(tokens)
    bufs.positions[:bucket].add_(1)
    bufs.col.add_(1)
    bufs.step.add_(1)
    if eos_ids is not None:
        bufs.finished[:bucket] |= torch.isin(tokens, eos_ids)
    if budgets:  # each row's own budget (by sample id) reached with this token
        bufs.finished[:bucket] |= bufs.budgets.index_select(0, rows) <= bufs.step
    if has_seen:
        bufs.seen[:bucket].scatter_(1, tokens[:, None], True)

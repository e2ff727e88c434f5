"""Static buffers and the captured step of the continuous route's decode (CUDA graphs per bucket).

The continuous route's live rows change every step (admissions, retirements, compaction) and its
aligned cache's front moves by one column per step, so the eager step reads a different window each
time. To replay one CUDA graph per (batch bucket, read window), as the ordinary route does, the
captured step reads only static tensors:

- the aligned cache's ``valid [slots, capacity]`` mask and ``write_col`` (set outside the graph by
  ``AlignedKVCache.begin_decode``), and the KV storage, whose addresses never change;
- ``rowdata [3, slots]``: each row's sample id, token index and position id, copied in (one
  host->device copy from pinned memory) before every replay;
- ``last_tokens``, ``seen``, ``generated`` and ``seed``: the run's state lives here instead of in
  per-call tensors.

Attention reads the live window widened to multiples of ``plan.buckets.LENGTH_BUCKET``
(:func:`rollout.plan.buckets.read_window`; the extra columns are masked by ``valid``, whose invariant keeps every column
outside a live row's span False), so one graph serves every step whose window rounds to the same
columns. A live batch of ``n`` rows runs in the batch bucket ``b >= n``: the ``b - n`` padding slots
are free slots (the scheduler keeps live rows a prefix) whose results are never read — their KV
column is rewritten or masked before any live row uses it, their token goes to ``generated``'s extra
dummy row, and an admitted row resets its ``seen`` and ``last_tokens``. The cache therefore needs
``batch_bucket(slots)`` rows.
"""

from __future__ import annotations

from typing import Optional

import torch

from rollout.model.step import StepParts, decode_logits
from rollout.ops.sampling import Sampler


class CBBuffers:
    """Persistent static tensors of the continuous route's decode, sized for ``slots`` rows (a batch
    bucket) x ``capacity`` columns, ``rows`` output rows (+1 dummy) x ``max_new_tokens``."""

    def __init__(self, slots: int, capacity: int, rows: int, max_new_tokens: int, vocab_size: int, device,
                 with_seen: bool):
        self.shape = (slots, capacity, rows, max_new_tokens, vocab_size, torch.device(device), with_seen)
        long = dict(dtype=torch.long, device=device)
        self.rowdata = torch.zeros((3, slots), **long)
        self.last_tokens = torch.zeros(slots, **long)
        self.seen = torch.zeros((slots, vocab_size), dtype=torch.bool, device=device) if with_seen else None
        self.generated = torch.zeros((rows + 1, max_new_tokens), **long)  # the last row: padding slots' sink
        self.logprobs = torch.zeros((rows + 1, max_new_tokens), dtype=torch.float32, device=device)
        self.seed = torch.zeros((), **long)
        self.valid = torch.zeros((slots, capacity), dtype=torch.bool, device=device)
        self.write_col = torch.zeros(1, **long)

    def fits(self, slots: int, capacity: int, rows: int, max_new_tokens: int, vocab_size: int, device,
             with_seen: bool) -> bool:
        have_slots, have_cap, have_rows, have_new, vocab, dev, seen = self.shape
        return (slots == have_slots and capacity == have_cap and rows <= have_rows and max_new_tokens <= have_new
                and vocab == vocab_size and dev == torch.device(device) and (seen or not with_seen))

    @property
    def dummy_row(self) -> int:
        return self.generated.shape[0] - 1

    def start(self, seed: int, use_seen: bool) -> tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
        """A call starts from clean buffers: ``(seen or None, last_tokens, generated, seed)``, filled in place."""
        seen = self.seen if use_seen else None
        if seen is not None:
            seen.zero_()
        self.last_tokens.zero_()
        self.generated.zero_()  # [>= B*n + 1, >= T_r]: the last row is the padding slots' sink
        self.logprobs.zero_()
        self.seed.fill_(seed)
        return seen, self.last_tokens, self.generated, self.seed

    def mutable(self) -> list[torch.Tensor]:
        """What one step writes (saved and restored around a capture's warm-up runs)."""
        return [t for t in (self.last_tokens, self.seen, self.generated, self.logprobs) if t is not None]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in vars(self).values() if isinstance(t, torch.Tensor))


def cb_decode_step(parts: StepParts, cache, bufs: CBBuffers, bucket: int, window: tuple[int, int],
                   sampler: Sampler, has_seen: bool, with_logprobs: bool = False) -> None:
    """The captured work of one continuous decode step over slots ``[0, bucket)`` and the columns of
    ``window``: logits, token choice, and the buffer updates (no host sync). The window reaches up to 255
    columns past the front (``read_window``'s rounding), which no live row attends (``AlignedKVCache``'s
    invariant of ``valid``)."""
    start, stop = window
    keep = cache.valid[:bucket, None, None, start:stop]
    rowdata = bufs.rowdata[:, :bucket]
    logits = decode_logits(parts, cache.key_storage[:, :bucket], cache.value_storage[:, :bucket],
                           bufs.last_tokens[:bucket], rowdata[2], cache.write_col, keep, start=start)
    seen = bufs.seen[:bucket] if has_seen else None
    tokens, logprobs = sampler(logits, seen, bufs.seed, rowdata[0], rowdata[1], with_logprobs)  # [bucket]
    bufs.last_tokens[:bucket].copy_(tokens)
    if logprobs is not None:
        bufs.logprobs.index_put_((rowdata[0], rowdata[1]), logprobs)
    if has_seen:
        bufs.seen[:bucket].scatter_(1, tokens[:, None], True)
    bufs.generated.index_put_((rowdata[0], rowdata[1]), tokens)

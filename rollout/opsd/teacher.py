"""The teacher side of the OPSD step: privileged prompts, token-id alignment checks, the stream of cached logits."""

from __future__ import annotations

import itertools
from typing import Callable, Optional, Sequence

import torch

from rollout.checks import require
from rollout.engine import token_ids
from rollout.opsd.logit_cache import TeacherLogitCache
from rollout.opsd.micro_batches import Span
from rollout.ops.expand import expand_prompts
from rollout.request import RolloutRequest


def config_token_ids(config) -> tuple[Optional[set], Optional[int]]:
    """``(eos ids or None, pad id or None)`` from a model config (None where unknown)."""
    eos = getattr(config, "eos_token_id", None)
    eos_ids = None if eos is None else set(eos if isinstance(eos, (list, tuple)) else [eos])
    return eos_ids, getattr(config, "pad_token_id", None)


class TeacherStream:
    """Teacher logit caches over consecutive spans of the processing order, built just before the
    student micro-batches that read them and freed once those have read them.

    ``build(span)`` runs the teacher over one chunk (a span of the order) and returns its cache;
    ``row_positions`` are the loss positions of each row of the order (a chunk's cache packs its
    rows' positions row-major, so a row span is a slice of it). With chunks equal to the student's
    micro-batches at most one micro-batch of teacher logits is held at a time.
    """

    def __init__(self, build: Callable[[Span], TeacherLogitCache], chunks: Sequence[Span],
                 row_positions: Sequence[int]):
        self._build, self._chunks = build, list(chunks)
        self._offsets = [0, *itertools.accumulate(row_positions)]  # position offset of each row
        self._caches: dict[int, TeacherLogitCache] = {}
        self._built = 0  # chunks built so far (in order)

    def _overlapping(self, span: Span) -> list[int]:
        return [i for i, (start, stop) in enumerate(self._chunks) if start < span[1] and span[0] < stop]

    def prepare(self, span: Span) -> None:
        """Build every chunk that ``span`` reads and that is not built yet."""
        for index in self._overlapping(span):
            while self._built <= index:
                self._caches[self._built] = self._build(self._chunks[self._built])
                self._built += 1

    def take(self, span: Span, device) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Packed teacher values ``[n, V|K]`` (and top-k ids) of ``span``'s rows, on ``device``."""
        parts = []
        for index in self._overlapping(span):
            start, stop = self._chunks[index]
            base = self._offsets[start]
            first, last = self._offsets[max(start, span[0])] - base, self._offsets[min(stop, span[1])] - base
            parts.append(self._caches[index].take(first, last, device))
        if len(parts) == 1:
            return parts[0]
        ids = None if parts[0][1] is None else torch.cat([part[1] for part in parts])
        return torch.cat([part[0] for part in parts]), ids

    def release(self, span: Span) -> None:
        """Free the caches of the chunks that end within ``span`` (nothing later reads them)."""
        for index in [i for i in self._caches if self._chunks[i][1] <= span[1]]:
            self._caches.pop(index).free()

    def close(self) -> None:
        """Free every cache still held."""
        for cache in self._caches.values():
            cache.free()
        self._caches.clear()

    @property
    def num_built(self) -> int:
        """Teacher forwards run so far."""
        return self._built


def expanded_teacher_prompts(ids, mask, num_rows: int, num_samples: int):
    """``(ids, mask)`` ``[B*n, T_t]`` of the teacher's prompts, or None when none are given."""
    if ids is None and mask is None:
        return None
    require(ids is not None and mask is not None, "teacher_prompt_ids",
             "teacher_prompt_ids and teacher_prompt_attention_mask go together")
    try:
        teacher = RolloutRequest(ids, mask)
    except ValueError as exc:
        raise ValueError(f"teacher_{exc}") from None
    require(teacher.batch_size == num_rows, "teacher_prompt_ids",
             f"needs {num_rows} rows (one per prompt or rollout row); got {teacher.batch_size}")
    return expand_prompts(ids, mask, num_samples)


def check_teacher_tokens(tokenizer, teacher_tokenizer, teacher_config) -> None:
    """ValueError when the teacher's EOS/pad ids or token->id map differ from the student's."""
    student_eos, student_pad = token_ids(tokenizer)
    if teacher_tokenizer is not None:
        eos, pad = token_ids(teacher_tokenizer)
        teacher_eos, source = set(eos), "teacher_tokenizer"
    else:
        teacher_eos, pad = config_token_ids(teacher_config)
        source = "teacher config"
    if teacher_eos is not None and not set(student_eos) <= teacher_eos:
        raise ValueError(f"{source} eos_token_id: {sorted(teacher_eos)} does not contain the student "
                         f"tokenizer's EOS ids {sorted(student_eos)}; the teacher cannot be aligned")
    if pad is not None and pad != student_pad:
        raise ValueError(f"{source} pad_token_id: {pad} differs from the student tokenizer's {student_pad}")
    if teacher_tokenizer is not None:
        check_vocab_map(tokenizer, teacher_tokenizer)


def check_vocab_map(tokenizer, teacher_tokenizer) -> None:
    """Every token both tokenizers know must have the same id (skipped without ``get_vocab``)."""
    if not all(callable(getattr(tok, "get_vocab", None)) for tok in (tokenizer, teacher_tokenizer)):
        return
    teacher_vocab = teacher_tokenizer.get_vocab()
    for token, token_id in tokenizer.get_vocab().items():
        other = teacher_vocab.get(token)
        if other is not None and other != token_id:
            raise ValueError(f"teacher_tokenizer vocabulary: token {token!r} has id {token_id} for the "
                             f"student but {other} for the teacher; the logits cannot be aligned")

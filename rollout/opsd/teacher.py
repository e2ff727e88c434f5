"""The teacher side of the OPSD step: privileged prompts, token-id alignment checks, gathering cached logits."""

from __future__ import annotations

from typing import Optional

import torch

from rollout.checks import require
from rollout.engine import token_ids
from rollout.opsd.logit_cache import TeacherLogitCache
from rollout.ops.expand import expand_prompts
from rollout.request import RolloutRequest


def config_token_ids(config) -> tuple[Optional[set], Optional[int]]:
    """``(eos ids or None, pad id or None)`` from a model config (None where unknown)."""
    eos = getattr(config, "eos_token_id", None)
    eos_ids = None if eos is None else set(eos if isinstance(eos, (list, tuple)) else [eos])
    return eos_ids, getattr(config, "pad_token_id", None)


def gather_caches(caches: list[TeacherLogitCache], device) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Packed ``[N, V|K]`` teacher values (and top-k ids) of all row chunks, on ``device``."""
    parts = [cache.to_device(device) for cache in caches]
    if len(parts) == 1:
        return parts[0].values, parts[0].ids
    values = torch.cat([p.values for p in parts])  # row-major order is kept: chunks are row ranges
    ids = None if parts[0].ids is None else torch.cat([p.ids for p in parts])
    return values, ids


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

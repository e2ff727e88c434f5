"""Next-token selection: repetition penalty, temperature, top-k, top-p, greedy or seeded sampling.

Everything runs on the device without host syncs, with tensors only (so a decode step that
includes it can be captured in a CUDA graph). The order follows HF ``generate``: repetition
penalty, then temperature, top-k, top-p. Logits are processed in fp32.

Sampling uses the Gumbel-max trick with *counter-based* noise: the uniform variate for token ``v``
of sample ``r`` at step ``t`` is a hash of ``(seed, r, t, v)``. Hence, for a given seed, a sample's
tokens depend only on its own logits — not on its batch neighbours, the batch size, the route or
the device's RNG state — and no generator state needs to live inside a CUDA graph.
"""

from __future__ import annotations

import torch

from rollout.config import SamplingConfig

_MASK32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # < 2**27: products of 32-bit values stay below 2**63 in int64
_ROW_SALT, _STEP_SALT = 0x9E3779B1 & 0x7FFFFFF, 0x85EBCA6B & 0x7FFFFFF


def hash32(x: torch.Tensor) -> torch.Tensor:
    """An avalanche integer hash of the low 32 bits of an int64 tensor (result in [0, 2**32))."""
    x = x & _MASK32
    x = ((x >> 16) ^ x) * _MUL & _MASK32
    x = ((x >> 16) ^ x) * _MUL & _MASK32
    return (x >> 16) ^ x


def uniform_noise(seed: torch.Tensor, rows: torch.Tensor, step: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``u [B, V]`` in (0, 1) from int64 tensors ``seed`` (scalar), ``rows [B]``, ``step`` (scalar)."""
    base = hash32(hash32(seed ^ (rows * _ROW_SALT)) ^ (step * _STEP_SALT))  # [B]
    ids = torch.arange(vocab_size, device=rows.device, dtype=torch.long)
    bits = hash32(base[:, None] ^ (ids[None, :] * _MUL))  # [B, V]
    return (bits.float() + 0.5) * (1.0 / 4294967296.0)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """HF semantics: for every token id present in the history (``seen [B, V]`` bool), divide a
    positive logit by ``penalty`` and multiply a negative one by it."""
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalised, logits)


def filter_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep the ``top_k`` largest logits per row (ties at the k-th value are kept, as in HF)."""
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def filter_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filtering with HF semantics: drop the lowest-probability tokens whose cumulative
    probability stays <= 1 - top_p; the most likely token always survives."""
    if top_p >= 1.0:
        return logits
    sorted_logits, sorted_idx = torch.sort(logits, descending=False, dim=-1)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= (1.0 - top_p)
    remove_sorted[..., -1] = False
    remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def draw_seed(sampling: SamplingConfig) -> int:
    """The call's seed: ``sampling.seed``, or one drawn from torch's global RNG when it is None."""
    if sampling.seed is not None:
        return sampling.seed & _MASK32
    return int(torch.randint(0, 2**31 - 1, (1,)).item())


def select_next_token(logits: torch.Tensor, sampling: SamplingConfig, seen: torch.Tensor | None,
                      seed: torch.Tensor, rows: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """``next_tokens [B]`` from the last-position ``logits [B, V]``.

    ``seed`` (scalar), ``rows [B]`` (each row's sample id: its row in the expanded batch) and
    ``step`` (scalar, the index of the token being produced) are int64 tensors keying the noise.
    """
    scores = logits.float()
    if seen is not None:
        scores = apply_repetition_penalty(scores, seen, sampling.repetition_penalty)
    if sampling.is_greedy:
        return scores.argmax(dim=-1)
    scores = scores / sampling.temperature
    scores = filter_top_p(filter_top_k(scores, sampling.top_k), sampling.top_p)
    gumbel = -torch.log(-torch.log(uniform_noise(seed, rows, step, scores.shape[-1])))
    return (scores + gumbel).argmax(dim=-1)

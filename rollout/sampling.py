"""Next-token selection: repetition penalty, temperature, top-k, top-p, greedy or seeded sampling.

Everything runs on the device without host syncs. The order follows HF ``generate``: repetition
penalty, then temperature, top-k, top-p. Logits are processed in fp32.
"""

from __future__ import annotations

import torch

from rollout.config import SamplingConfig


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


def make_generator(sampling: SamplingConfig, device: torch.device) -> torch.Generator | None:
    """A generator seeded from ``sampling.seed`` (None: use torch's global RNG)."""
    if sampling.seed is None or sampling.is_greedy:
        return None
    return torch.Generator(device=device).manual_seed(sampling.seed)


def select_next_token(logits: torch.Tensor, sampling: SamplingConfig, seen: torch.Tensor | None,
                      generator: torch.Generator | None) -> torch.Tensor:
    """``next_tokens [B]`` from the last-position ``logits [B, V]``."""
    scores = logits.float()
    if seen is not None:
        scores = apply_repetition_penalty(scores, seen, sampling.repetition_penalty)
    if sampling.is_greedy:
        return scores.argmax(dim=-1)
    scores = scores / sampling.temperature
    scores = filter_top_p(filter_top_k(scores, sampling.top_k), sampling.top_p)
    probs = scores.softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)

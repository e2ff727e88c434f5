"""Next-token selection: repetition penalty, temperature, top-k, top-p, greedy or seeded sampling.

No host syncs, no data-dependent shapes (a decode step that includes it can be captured in a CUDA
graph). The order follows HF ``generate``: repetition penalty, temperature, top-k, top-p; in fp32.

Sampling uses the Gumbel-max trick with *counter-based* noise: the uniform variate for token ``v``
of sample ``r`` at step ``t`` is a hash of ``(seed, r, t, v)``. Hence, for a given seed, a sample's
tokens depend only on its own logits — not on its batch neighbours, the batch size, the route or
the device's RNG state — and no generator state needs to live inside a CUDA graph.

Two nucleus (top-p) filters with the semantics of HF's ``TopPLogitsWarper`` (ascending stable order,
cumulative softmax, drop where it is ``<= 1 - top_p``, keep the most likely token): ``filter_top_p``
sorts, as HF does (the eager path); ``top_p_keep`` does not (the compiled path, :class:`Sampler`): a
search over the scores' order-preserving int32 bit patterns for the boundary score (each pass
evaluates 15 thresholds in one fused reduction), then the straddling tie group loses its lowest-index
members, ``floor((1 - top_p - mass strictly below) / p)`` of them, as a stable sort's cumulative sum
does. It sums masses in another order than HF's cumulative sum, so the two differ only where a
cumulative sum lies within rounding (~1e-7) of ``1 - top_p``.
"""

from __future__ import annotations

import functools
import itertools
import types
from dataclasses import dataclass
from typing import Optional

import torch

from rollout.checks import require
from rollout.config import SamplingConfig
from rollout.ops import fused_nucleus
from rollout.ops.nucleus import top_p_keep

_MASK32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # < 2**27: products of 32-bit values stay below 2**63 in int64
_ROW_SALT, _STEP_SALT = 0x9E3779B1 & 0x7FFFFFF, 0x85EBCA6B & 0x7FFFFFF
_ENTRY_IDS = itertools.count()


def hash32(x: torch.Tensor) -> torch.Tensor:
    """An avalanche integer hash of the low 32 bits of an int64 tensor (result in [0, 2**32))."""
    x = x & _MASK32
    x = ((x >> 16) ^ x) * _MUL & _MASK32
    x = ((x >> 16) ^ x) * _MUL & _MASK32
    return (x >> 16) ^ x


#: The largest float32 below 1 (1 - 2**-24): where the uniform variates stop. A 32-bit hash rounds to 2**32 in float32
#: for its top 128 values, so ``(bits + 0.5) / 2**32`` was 1.0 there (probability 2**-25 a token), its Gumbel noise
#: ``-log(-log 1)`` infinite, and that token drawn whatever its score: 0.45% of the rows a step at a 151,936-token
#: vocabulary drew a uniformly random token. Capped here, its noise is 16.6, the largest any other variate gets.
UNIFORM_MAX = 1.0 - 2.0 ** -24


def uniform_noise(seed: torch.Tensor, rows: torch.Tensor, step: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``u [B, V]`` in (0, 1) from int64 tensors ``seed`` (scalar), ``rows [B]``, ``step`` (scalar): at most
    :data:`UNIFORM_MAX`, so the Gumbel noise ``-log(-log u)`` stays finite (the Triton kernels cap it the same way)."""
    base = hash32(hash32(seed ^ (rows * _ROW_SALT)) ^ (step * _STEP_SALT))  # [B]
    ids = torch.arange(vocab_size, device=rows.device, dtype=torch.long)
    bits = hash32(base[:, None] ^ (ids[None, :] * _MUL))  # [B, V]
    return ((bits.float() + 0.5) * (1.0 / 4294967296.0)).clamp_(max=UNIFORM_MAX)


def prompt_history(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The prompt ids ``[N, T_p]`` (int64) a row's repetition history starts from, as HF ``generate`` counts them
    (transformers 5.24): every position from the row's first real token on (a masked hole after it counts, as there),
    not the left padding before it; those positions repeat the row's first real token, counted anyway. Counting the
    padding (as transformers 5.17 does) penalised the pad id in the rows that had padding only, so a row's tokens
    depended on the other prompts of its batch."""
    first = (mask != 0).int().argmax(dim=1, keepdim=True)  # [N, 1]
    lead = torch.arange(ids.shape[1], device=ids.device)[None, :] < first
    return torch.where(lead, ids.gather(1, first), ids).long()


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
    """Nucleus filtering by sorting, HF's own algorithm: drop the lowest-probability tokens whose
    cumulative probability stays <= 1 - top_p; the most likely token always survives."""
    if top_p >= 1.0:
        return logits
    sorted_logits, sorted_idx = torch.sort(logits, descending=False, dim=-1)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= (1.0 - top_p)
    remove_sorted[..., -1] = False
    remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


@dataclass(frozen=True)
class SamplerKey:
    """What token selection depends on (one :class:`Sampler` per key)."""

    temperature: float
    """``<= 0``: greedy."""
    top_k: int
    """``<= 0`` disables it."""
    top_p: float
    """1 disables it."""
    repetition_penalty: float
    """Applied where a ``seen`` history is given."""

    def __post_init__(self) -> None:
        require(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1]; got {self.top_p!r}")
        require(self.repetition_penalty > 0, "repetition_penalty", f"must be > 0; got {self.repetition_penalty!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0


def sampler_key(sampling: SamplingConfig) -> SamplerKey:
    return SamplerKey(float(sampling.temperature), int(sampling.top_k), float(sampling.top_p),
                      float(sampling.repetition_penalty))


def _key_shift(dtype: torch.dtype, key: SamplerKey, seen: Optional[torch.Tensor]) -> int:
    """Key bits that are zero in every score: fp32 scores cast exactly from bf16/fp16 logits."""
    exact = key.temperature == 1.0 and (seen is None or key.repetition_penalty == 1.0)
    return fused_nucleus.key_shift(dtype) if exact and dtype.is_floating_point else 0


def _scores(logits: torch.Tensor, key: SamplerKey, seen: Optional[torch.Tensor], search: bool) -> torch.Tensor:
    """fp32 scores of the distribution sampled from: penalty, temperature, top-k, top-p (-inf where
    filtered). Greedy: the penalised logits (temperature 1, no filtering)."""
    scores = logits.float()
    if seen is not None:
        scores = apply_repetition_penalty(scores, seen, key.repetition_penalty)
    if key.is_greedy:
        return scores
    scores = filter_top_k(scores / key.temperature, key.top_k)
    if key.top_p >= 1.0:
        return scores
    if not search:
        return filter_top_p(scores, key.top_p)
    keep = top_p_keep(scores, key.top_p, _key_shift(logits.dtype, key, seen))
    return scores.masked_fill(~keep, float("-inf"))


def _select(logits, key: SamplerKey, seen, seed, rows, step, with_logprobs: bool, search: bool):
    """``(tokens [B], logprobs [B] or None)``; ``search``: the sort-free nucleus filter."""
    scores = _scores(logits, key, seen, search)
    if key.is_greedy:
        tokens = scores.argmax(dim=-1)
    else:
        gumbel = -torch.log(-torch.log(uniform_noise(seed, rows, step, scores.shape[-1])))
        tokens = (scores + gumbel).argmax(dim=-1)
    if not with_logprobs:
        return tokens, None
    return tokens, torch.log_softmax(scores, dim=-1).gather(1, tokens[:, None])[:, 0]


def draw_seed(sampling: SamplingConfig) -> int:
    """The call's seed: ``sampling.seed``, or one drawn from torch's global RNG when it is None."""
    if sampling.seed is not None:
        return sampling.seed & _MASK32
    return int(torch.randint(0, 2**31 - 1, (1,)).item())


def select_next_token(logits: torch.Tensor, sampling: SamplingConfig, seen: torch.Tensor | None,
                      seed: torch.Tensor, rows: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """``next_tokens [B]`` from the last-position ``logits [B, V]`` (eager; the nucleus by sorting).

    ``seed`` (scalar), ``rows [B]`` (each row's sample id: its row in the expanded batch) and
    ``step`` (scalar, the index of the token being produced) are int64 tensors keying the noise.
    """
    return _select(logits, sampler_key(sampling), seen, seed, rows, step, False, search=False)[0]


def sampled_logprobs(logits: torch.Tensor, sampling: SamplingConfig, seen: torch.Tensor | None,
                     tokens: torch.Tensor) -> torch.Tensor:
    """``[B]`` float32: log-probability of ``tokens`` under the distribution sampled from (log-softmax
    over the kept set after penalty, temperature, top-k, top-p; -inf for a filtered token). Greedy:
    the log-softmax of the penalised logits at temperature 1, without filtering."""
    scores = _scores(logits, sampler_key(sampling), seen, search=False)
    return torch.log_softmax(scores, dim=-1).gather(1, tokens[:, None])[:, 0]


class Sampler:
    """Token selection for one :class:`SamplerKey`, for the executors:
    ``sampler(logits, seen, seed, rows, step, with_logprobs) -> (tokens [B], logprobs [B] fp32 or None)``.

    ``compiled=True``: ``torch.compile(fullgraph=True)`` functions with the sort-free nucleus, compiled at
    the first call (a CUDA graph's warm-up runs, outside capture; the batch dimension is dynamic). If
    building or a call raises, it falls back to the eager functions for good and says why in
    ``fallback_reason``. Tokens equal the eager ones except where rounding decides (see above).

    ``fused`` (with ``compiled``): temperature + top-p sampling on CUDA logits without top-k or a
    repetition penalty runs the Triton nucleus of :mod:`rollout.ops.fused_nucleus` instead (same
    keys, same semantics), and plain temperature sampling (top-p 1) its one-pass Gumbel-max
    (``fused_nucleus.sample_plain``: the same noise and tie order, so the same tokens); if either raises,
    the compiled functions take over for good, with the reason.
    """

    def __init__(self, key: SamplerKey, compiled: bool, fused: bool = True, chunk_tokens: Optional[int] = None):
        self.key = key
        self.chunk_tokens = chunk_tokens
        """The fused kernels' tokens per program (``RolloutConfig.sampler.chunk_tokens``; None: their default)."""
        self.fallback_reason: Optional[str] = None
        """Why the compiled functions (or the fused kernel) were dropped (None: never built or still in use)."""
        self._fused = bool(compiled and fused and not key.is_greedy and key.top_k <= 0)
        self.last_path = "eager"
        """What the latest call ran: ``"fused"``, ``"compiled"`` or ``"eager"``."""
        self._compiled: dict[bool, object] = {}
        if compiled:
            try:
                self._compiled = {flag: torch.compile(_entry(key, flag), fullgraph=True, dynamic=None)
                                  for flag in (False, True)}
            except Exception as exc:  # noqa: BLE001 - sampling still works, eagerly, and stats say why
                self._drop("torch.compile", exc)

    @property
    def is_compiled(self) -> bool:
        return bool(self._compiled)

    @property
    def is_fused(self) -> bool:
        """Whether CUDA calls of this key run the Triton kernels (the nucleus, or top-p 1's plain draw) until they
        raise."""
        return self._fused

    def _drop(self, where: str, exc: Exception) -> None:
        self._compiled = {}
        self.fallback_reason = f"compiled sampler: {where} raised {exc!r:.300}; sampling eagerly"

    def __call__(self, logits: torch.Tensor, seen: Optional[torch.Tensor], seed: torch.Tensor,
                 rows: torch.Tensor, step: torch.Tensor, with_logprobs: bool = False):
        key = self.key
        penalised = seen is not None and key.repetition_penalty != 1.0
        plain = key.top_p >= 1.0
        supports = fused_nucleus.supports_plain if plain else fused_nucleus.supports
        if self._fused and supports(logits, key.temperature, key.top_k, key.top_p, penalised):
            try:
                if plain:
                    result = fused_nucleus.sample_plain(logits, key.temperature, seed, rows, step, bool(with_logprobs),
                                                        chunk_tokens=self.chunk_tokens)
                else:
                    result = fused_nucleus.sample_top_p(logits, key.temperature, key.top_p, seed, rows, step,
                                                        bool(with_logprobs), chunk_tokens=self.chunk_tokens)
                self.last_path = "fused"
                return result
            except Exception as exc:  # noqa: BLE001 - the compiled sampler still works; stats say why
                self._fused = False
                what = "plain sampling" if plain else "nucleus"
                self.fallback_reason = f"fused {what} kernel raised {exc!r:.300}; using the compiled sampler"
        fn = self._compiled.get(bool(with_logprobs))
        if fn is not None:
            try:
                for tensor in (logits, seen, rows):  # one graph for every batch bucket
                    if tensor is not None:
                        torch._dynamo.maybe_mark_dynamic(tensor, 0)
                result = fn(logits, seen, seed, rows, step)
                self.last_path = "compiled"
                return result
            except Exception as exc:  # noqa: BLE001 - as above
                self._drop("a call", exc)
        self.last_path = "eager"
        return _select(logits, key, seen, seed, rows, step, bool(with_logprobs), search=False)


def _entry(key: SamplerKey, with_logprobs: bool):
    """The function to compile, under a code object and name of its own: torch.compile keeps its
    recompile count and its automatic-dynamic state per code (by name), so samplers of other keys can
    neither use up this one's recompiles nor turn its constants (top_p, temperature) symbolic."""
    def sample(logits, seen, seed, rows, step):
        # traced by torch.compile: the sort-free nucleus; run eagerly (a dynamo fallback): sorting
        return _select(logits, key, seen, seed, rows, step, with_logprobs, search=torch.compiler.is_compiling())
    name = f"sample_{next(_ENTRY_IDS)}"
    code = sample.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, sample.__globals__, name, None, sample.__closure__)


@functools.lru_cache(maxsize=None)
def _cached_sampler(key: SamplerKey, compiled: bool, fused: bool, chunk_tokens: Optional[int]) -> Sampler:
    return Sampler(key, compiled, fused, chunk_tokens)


def sampler_fn(sampling: SamplingConfig, compiled: bool, fused: bool = True,
               chunk_tokens: Optional[int] = None) -> Sampler:
    """The process-wide :class:`Sampler` of ``sampling``'s key (``compiled``: pass True on CUDA; ``fused``:
    the Triton nucleus where it applies, with ``chunk_tokens`` tokens a program, None: its default)."""
    return _cached_sampler(sampler_key(sampling), bool(compiled), bool(fused),
                           None if chunk_tokens is None else int(chunk_tokens))

"""Prefill bucket planning from an additive cost model (pure Python, no torch).

A prefill *bucket* is one padded forward over some requests: ``B`` rows padded to the longest
prompt ``L`` of the bucket. ``CostModel.prefill_cost_ms(B, L)`` estimates its time as

    fixed + token * B*L + attention * GFLOPs(B, L) + kv * MiB(B, L)
    GFLOPs(B, L) = 4 * B * L^2 * num_layers * num_query_heads * head_dim / 1e9
    MiB(B, L)    = 2 * B * L * num_layers * num_kv_heads * head_dim * element_bytes / 2^20

which is ``fixed + B * row_cost_ms(L)``: linear in ``B`` for a fixed ``L``. ``plan_prefill_buckets``
sorts the requests by length and finds the exact minimum-cost partition into contiguous runs of
that order (an O(n log n) monotone-queue dynamic programme, see ``_last_bucket_starts``). The
route decision that uses it (``route="auto"``) is :mod:`rollout.plan.routes`. The coefficients are
estimates for one model/GPU/dtype/attention backend: calibrate them (``to_dict``/``from_dict``
carry them to and from JSON).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass, fields, replace
from typing import Any, Mapping, Optional, Sequence

from rollout.checks import is_int

DEFAULT_MAX_TOKENS = 65536
"""Default cap on padded token positions ``B * L`` of one prefill forward."""

_COEFFICIENTS = ("prefill_fixed_cost_ms", "prefill_token_cost_ms", "prefill_attention_cost_ms",
                 "prefill_kv_cost_ms", "continuous_decode_cost_ms", "prefill_group_cost_ms")
_GEOMETRY = ("num_layers", "num_query_heads", "num_kv_heads", "head_dim", "element_bytes")
_DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1,
                "float8_e5m2": 1}


@dataclass(frozen=True)
class CostModel:
    """Estimated prefill/decode costs; defaults are the seed PR's starting estimates on a Qwen2.5-3B geometry."""

    prefill_fixed_cost_ms: float = 25.0
    """Milliseconds per prefill forward, whatever its shape (launches, weight reads)."""
    prefill_token_cost_ms: float = 0.1
    """Milliseconds per padded token position ``B * L`` (projections and MLP)."""
    prefill_attention_cost_ms: float = 0.01
    """Milliseconds per estimated attention GFLOP (``4 B L^2 layers q_heads head_dim / 1e9``)."""
    prefill_kv_cost_ms: float = 0.04
    """Milliseconds per MiB of KV written into the continuous-batching cache (continuous route only)."""
    continuous_decode_cost_ms: float = 10.0
    """Extra milliseconds per decode step of the continuous route over the ordinary one."""
    prefill_group_cost_ms: float = 1.0
    """Milliseconds per extra attention group of a packed prefill (:mod:`rollout.fast_prefill`: the
    linear layers run once over the real tokens whatever the grouping; each group adds its attention
    launches per layer). Not one of the seed PR's terms; calibrated by ``scripts/calibrate_prefill.py``."""
    num_layers: int = 36
    """Decoder layers."""
    num_query_heads: int = 16
    """Attention (query) heads per layer."""
    num_kv_heads: int = 2
    """Key/value heads per layer (GQA)."""
    head_dim: int = 128
    """Channels per attention head."""
    element_bytes: int = 2
    """Bytes per KV element (2 for bf16/fp16, 4 for fp32)."""

    def __post_init__(self) -> None:
        for name in _COEFFICIENTS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name}: must be a finite number >= 0; got {value!r}")
        for name in _GEOMETRY:
            value = getattr(self, name)
            if not is_int(value) or value <= 0:
                raise ValueError(f"{name}: must be an int > 0; got {value!r}")
        # Per-row cost of a bucket padded to L is  L * _linear_ms + L^2 * _quadratic_ms.
        gflop_per_l2 = 4.0 * self.num_layers * self.num_query_heads * self.head_dim / 1e9
        mib_per_l = 2.0 * self.num_layers * self.num_kv_heads * self.head_dim * self.element_bytes / 2**20
        object.__setattr__(self, "_quadratic_ms", self.prefill_attention_cost_ms * gflop_per_l2)
        object.__setattr__(self, "_linear_ms", self.prefill_token_cost_ms + self.prefill_kv_cost_ms * mib_per_l)

    @classmethod
    def from_model(cls, model_or_config: Any, *, dtype: Any = None, **coefficients: float) -> "CostModel":
        """Read the geometry once from an HF model or config; ``coefficients`` override the defaults.

        ``head_dim`` is ``config.head_dim`` when set, else ``hidden_size // num_attention_heads``.
        ``element_bytes`` comes from ``dtype`` (a torch dtype or its name) when given, else from the
        model's first parameter, else from ``config.dtype``.
        """
        unknown = sorted(set(coefficients) - set(_COEFFICIENTS))
        if unknown:
            raise ValueError(f"coefficients: unknown names {unknown}; expected some of {_COEFFICIENTS}")
        config = getattr(model_or_config, "config", model_or_config)
        if hasattr(config, "get_text_config"):
            config = config.get_text_config()
        num_heads = getattr(config, "num_attention_heads", None)
        if not is_int(num_heads) or getattr(config, "num_hidden_layers", None) is None:
            raise ValueError(f"model_or_config: no num_attention_heads/num_hidden_layers on {type(config).__name__}")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        return cls(num_layers=config.num_hidden_layers, num_query_heads=num_heads, num_kv_heads=num_kv_heads,
                   head_dim=head_dim, element_bytes=_element_bytes(model_or_config, config, dtype), **coefficients)

    def attention_gflops(self, batch_size: int, length: int) -> float:
        """Estimated attention GFLOPs of one prefill forward of ``batch_size`` rows of ``length`` tokens."""
        return 4.0 * batch_size * length * length * self.num_layers * self.num_query_heads * self.head_dim / 1e9

    def kv_mib(self, batch_size: int, length: int) -> float:
        """MiB of keys and values that forward writes (all layers)."""
        return (2.0 * batch_size * length * self.num_layers * self.num_kv_heads * self.head_dim
                * self.element_bytes / 2**20)

    def prefill_cost_ms(self, batch_size: int, length: int) -> float:
        """Estimated ms of one continuous-route prefill forward: ``batch_size`` rows padded to ``length``."""
        return (self.prefill_fixed_cost_ms + self.prefill_token_cost_ms * batch_size * length
                + self.prefill_attention_cost_ms * self.attention_gflops(batch_size, length)
                + self.prefill_kv_cost_ms * self.kv_mib(batch_size, length))

    def ordinary_prefill_cost_ms(self, batch_size: int, length: int) -> float:
        """Like ``prefill_cost_ms`` without the KV-copy term (the ordinary route writes its own cache)."""
        return (self.prefill_fixed_cost_ms + self.prefill_token_cost_ms * batch_size * length
                + self.prefill_attention_cost_ms * self.attention_gflops(batch_size, length))

    def packed(self, copy_kv: bool = False, varlen: bool = False) -> "CostModel":
        """The model of grouping a *packed* prefill (:mod:`rollout.fast_prefill`): the token term does not
        depend on the grouping (the linear layers see only real tokens), so a group costs
        ``prefill_group_cost_ms + attention * GFLOPs(B, L)`` (``varlen``: attention is exact per row,
        the term goes too) ``+ kv * MiB(B, L)`` when ``copy_kv`` (the continuous route copies each
        group's padded keys/values into its cache). ``plan_prefill_buckets`` on this model plans the
        groups of one pass instead of forwards."""
        return replace(self, prefill_fixed_cost_ms=self.prefill_group_cost_ms, prefill_token_cost_ms=0.0,
                       prefill_attention_cost_ms=0.0 if varlen else self.prefill_attention_cost_ms,
                       prefill_kv_cost_ms=self.prefill_kv_cost_ms if copy_kv else 0.0)

    def row_cost_ms(self, length: int) -> float:
        """Marginal ms of one more row in a bucket padded to ``length`` (``prefill_cost_ms = fixed + B * this``)."""
        return length * self._linear_ms + length * length * self._quadratic_ms

    def to_dict(self) -> dict:
        """Coefficients and geometry as a JSON-ready dict (inverse of ``from_dict``)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "CostModel":
        """Build from ``to_dict`` output; unknown keys raise ``ValueError`` (missing ones take defaults)."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"data: unknown CostModel fields {unknown}")
        return cls(**dict(data))


def _element_bytes(model_or_config: Any, config: Any, dtype: Any) -> int:
    if dtype is None and hasattr(model_or_config, "parameters"):
        dtype = next(iter(model_or_config.parameters()), None)
        dtype = getattr(dtype, "dtype", None)
    if dtype is None:
        dtype = getattr(config, "dtype", None)
    itemsize = getattr(dtype, "itemsize", None)
    if is_int(itemsize):
        return int(itemsize)
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPE_BYTES:
        raise ValueError(f"dtype: cannot tell the element size of {dtype!r}; pass dtype=torch.bfloat16 or similar")
    return _DTYPE_BYTES[name]


@dataclass(frozen=True)
class PrefillPlan:
    """Prefill buckets: each a tuple of request indices (into the planned ``lengths``), one forward each."""

    buckets: tuple[tuple[int, ...], ...]
    """Buckets in ascending length order; inside a bucket indices ascend by (length, index)."""
    cost_ms: float
    """Sum of ``prefill_cost_ms(len(bucket), longest length in bucket)`` over the buckets."""


def _validated_lengths(lengths: Sequence[int], max_tokens: Optional[int]) -> list[int]:
    """``lengths`` as a list of ints > 0, each within ``max_tokens``; ``ValueError`` naming the argument."""
    if max_tokens is not None and (not is_int(max_tokens) or max_tokens <= 0):
        raise ValueError(f"max_tokens: must be None or an int > 0; got {max_tokens!r}")
    out = list(lengths)
    for index, value in enumerate(out):
        if type(value) is not int:
            if not is_int(value):
                raise ValueError(f"lengths[{index}]: must be an int; got {value!r}")
            out[index] = value = int(value)
        if value <= 0:
            raise ValueError(f"lengths[{index}]: must be > 0; got {value}")
    if max_tokens is not None and out and max(out) > max_tokens:
        index = out.index(max(out))
        raise ValueError(f"lengths[{index}]={out[index]} exceeds max_tokens={max_tokens}: "
                         "a single prompt must fit one prefill forward (there is no chunked prefill)")
    return out


def _expiry(sorted_lengths: list[int], max_tokens: Optional[int]) -> list[int]:
    """``expiry[k]``: the first end ``j`` at which a bucket starting at sorted position ``k`` exceeds the limit.

    Bucket ``k..j`` fits iff ``(j - k + 1) * L_j <= max_tokens``, i.e. ``k >= j + 1 - max_tokens // L_j``;
    that lower bound rises strictly with ``j`` (``L_j`` ascends), so one two-pointer pass finds it.
    """
    n = len(sorted_lengths)
    if max_tokens is None:
        return [n] * n
    lowest_start = [j + 1 - max_tokens // length for j, length in enumerate(sorted_lengths)]
    expiry, j = [0] * n, 0
    for k in range(n):
        while j < n and lowest_start[j] <= k:
            j += 1
        expiry[k] = j
    return expiry


def _last_bucket_starts(sorted_lengths: list[int], cost_model: CostModel, max_tokens: Optional[int]) -> list[int]:
    """``start[j]``: where the optimal last bucket of the first ``j + 1`` sorted requests begins.

    ``best[j+1] = min_k best[k] + fixed + b_j (j + 1 - k)`` with ``b_j = row_cost_ms(L_j)`` ascending.
    A later start ``i`` beats an earlier ``k`` at end ``j`` iff ``b_j > (best[i] - best[k]) / (i - k)``
    or ``k`` has expired (bucket over the token limit); both conditions, once true, stay true as ``j``
    grows (the cost is Monge), so a queue of candidates with the ends where each takes over is exact.
    Finding a take-over end is one C-level bisect, giving O(n log n). Ties keep the earlier start.
    """
    n = len(sorted_lengths)
    fixed = cost_model.prefill_fixed_cost_ms
    slope = [cost_model.row_cost_ms(length) for length in sorted_lengths]
    expiry = _expiry(sorted_lengths, max_tokens)
    best = [0.0] * (n + 1)
    start = [0] * n
    queue: list[int] = []   # candidate starts, ascending
    takes_over: list[int] = []  # end index from which queue[t] is the best candidate
    head = 0
    for j in range(n):
        i, best_i, take = j, best[j], j
        while len(queue) > head:
            k = queue[-1]
            take = bisect_right(slope, (best_i - best[k]) / (i - k), j, n)
            if expiry[k] < take:
                take = expiry[k]
            if take > takes_over[-1] and take > j:
                break
            queue.pop()
            takes_over.pop()
            take = j
        if take < n:
            queue.append(i)
            takes_over.append(take)
        while head + 1 < len(queue) and takes_over[head + 1] <= j:
            head += 1
        k = queue[head]
        start[j] = k
        best[j + 1] = best[k] + fixed + slope[j] * (j + 1 - k)
    return start


def plan_prefill_buckets(lengths: Sequence[int], cost_model: CostModel,
                         max_tokens: Optional[int] = DEFAULT_MAX_TOKENS) -> PrefillPlan:
    """The minimum-cost split of requests into prefill buckets, over contiguous runs of the length order.

    Requests are sorted by (length, index); a bucket of a contiguous run costs
    ``prefill_cost_ms(size, its longest length)`` and must satisfy ``size * longest <= max_tokens``
    (``None``: no limit). Exact for this cost model, in O(n log n). Tie-breaking is deterministic:
    when two starts of the last bucket cost the same, the earlier (larger bucket) wins.
    Raises ``ValueError`` for a non-int or non-positive length, a prompt longer than ``max_tokens``
    or a bad ``max_tokens``; empty ``lengths`` give an empty plan of cost 0.
    """
    values = _validated_lengths(lengths, max_tokens)
    if not values:
        return PrefillPlan(buckets=(), cost_ms=0.0)
    order = sorted(range(len(values)), key=values.__getitem__)
    sorted_lengths = [values[k] for k in order]
    return _plan_from_starts(order, sorted_lengths, _last_bucket_starts(sorted_lengths, cost_model, max_tokens),
                             cost_model)


def _plan_from_starts(order: list[int], sorted_lengths: list[int], start: list[int],
                      cost_model: CostModel) -> PrefillPlan:
    buckets, cost_ms, j = [], 0.0, len(order) - 1
    while j >= 0:
        k = start[j]
        buckets.append(tuple(order[k:j + 1]))
        cost_ms += cost_model.prefill_cost_ms(j + 1 - k, sorted_lengths[j])
        j = k - 1
    return PrefillPlan(buckets=tuple(reversed(buckets)), cost_ms=cost_ms)


def reference_plan_prefill_buckets(lengths: Sequence[int], cost_model: CostModel,
                                   max_tokens: Optional[int] = DEFAULT_MAX_TOKENS) -> PrefillPlan:
    """The plain O(n^2) DP over all contiguous runs (same semantics and tie rule); an oracle for tests/benchmarks."""
    values = _validated_lengths(lengths, max_tokens)
    order = sorted(range(len(values)), key=values.__getitem__)
    sorted_lengths = [values[k] for k in order]
    best, start = [0.0] + [math.inf] * len(order), [0] * len(order)
    for j, length in enumerate(sorted_lengths):
        for k in range(j + 1):
            if max_tokens is not None and (j + 1 - k) * length > max_tokens:
                continue
            cost = best[k] + cost_model.prefill_cost_ms(j + 1 - k, length)
            if cost < best[j + 1]:
                best[j + 1], start[j] = cost, k
    return _plan_from_starts(order, sorted_lengths, start, cost_model)

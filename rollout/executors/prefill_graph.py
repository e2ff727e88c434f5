"""The packed prefill replayed from CUDA graphs, one graph per shape bucket
(``RolloutConfig.kernels.prefill_graph_tokens``).

Why: a prefill pass of the 3B shape costs ~22-28 ms of host time on an H200 (36 layers of compiled pieces,
variable-length attention and cache writes, each a few hundred microseconds of Python and launches), while
its GPU work for the ~1,000 prompt tokens of a short call is a few milliseconds (``docs/BENCHMARKS.md``, seed
004): the GPU waits on the host, and a call of 16 new tokens spends about a quarter of its time there. The
continuous route pays it again for every refill pass. Replayed from a graph, the pass costs one launch.

How: :func:`rollout.model.prefill.packed_logits`, the eager pass itself, runs over static buffers of a
:class:`PrefillShape`:

- the packed real tokens, padded to a token bucket (a power of two, at least ``MIN_TOKENS``) with token 0 at
  position 0;
- variable-length attention over segments: the real rows, zero-length rows up to the row bucket, the padding
  tokens cut into segments of at most the length bucket (so the captured ``max_len`` bounds every segment),
  then zero-length segments up to the buffer's fixed size (:func:`padded_segments`). Padding tokens attend only
  among themselves, and nothing reads them;
- each layer's keys and values go into a staging buffer ``[layers, tokens, Hkv, D]``; after the replay two
  ``index_put_`` write the real tokens' into the cache, so a graph does not depend on the cache's address;
- the logits of each row's last real token are copied into an output buffer (padded rows read token 0), and
  from it after the replay. The staging and output buffers are shared by every shape's graph and grow to the
  largest bucket seen; growing one drops the graphs captured over it.

Graphs are keyed by the shape and the weights' addresses (as the decode graphs). The first pass of a new key
runs twice to warm up and is captured (``rollout.executors.graphs``); later ones replay. Where the pass cannot
run from a graph (not CUDA, no variable-length attention, more real tokens than the limit) :meth:`run` returns
None and the eager pass runs; a failure warns once and leaves the eager pass to every later call.

The arithmetic per token is the eager pass's, but its GEMMs see the padded token count, so in bf16 logits can
differ from the eager pass's by rounding (as between batch shapes of the decode step).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from rollout.cache.static import cache_shape
from rollout.checks import pow2_at_least
from rollout.executors.graphs import GRAPH, GraphSet
from rollout.model import prefill
from rollout.model.step import StepParts
from rollout.ops.host import to_device

#: The smallest token bucket (a short call's prefill pads to it).
MIN_TOKENS = 256
#: The smallest length bucket (the ``max_len`` variable-length attention is captured with).
MIN_LENGTH = 64


@dataclass(frozen=True)
class PrefillShape:
    """The buckets one graph is captured for."""

    tokens: int
    """Packed tokens, padding included (a power of two)."""
    rows: int
    """Rows (a power of two); the pass returns this many logits rows."""
    longest: int
    """The longest segment variable-length attention may see (a power of two, at most ``tokens``)."""

    @property
    def segments(self) -> int:
        """Segments of the attention (``cu_seq`` has one more entry): the rows, then room for the padding."""
        return self.rows + -(-self.tokens // self.longest)


def prefill_shape(real_counts: Sequence[int], max_tokens: int) -> Optional[PrefillShape]:
    """The shape of a pass over rows of ``real_counts`` real tokens, or None when it has more than
    ``max_tokens`` real tokens (or none)."""
    total = sum(real_counts)
    if not real_counts or total == 0 or total > max_tokens:
        return None
    tokens = pow2_at_least(total, MIN_TOKENS)
    return PrefillShape(tokens, pow2_at_least(len(real_counts), 1),
                        min(tokens, pow2_at_least(max(real_counts), MIN_LENGTH)))


def padded_segments(real_counts: Sequence[int], shape: PrefillShape) -> list[int]:
    """``cu_seq`` (``shape.segments + 1`` offsets) for rows of ``real_counts`` tokens packed in order, padded to
    ``shape`` as the module docstring says."""
    if len(real_counts) > shape.rows or sum(real_counts) > shape.tokens or max(real_counts) > shape.longest:
        raise ValueError(f"rows of {list(real_counts)} tokens do not fit {shape}")
    offsets = [0]
    for count in real_counts:
        offsets.append(offsets[-1] + count)
    offsets += [offsets[-1]] * (shape.rows - len(real_counts))  # zero-length rows
    while offsets[-1] < shape.tokens:  # the padding, in segments of at most `longest`
        offsets.append(min(shape.tokens, offsets[-1] + shape.longest))
    return offsets + [shape.tokens] * (shape.segments + 1 - len(offsets))


def padded_last(real_counts: Sequence[int], shape: PrefillShape) -> list[int]:
    """Packed index of each row's last real token, then 0 for the padded rows (``shape.rows`` entries)."""
    last, end = [], 0
    for count in real_counts:
        end += count
        last.append(end - 1)
    return last + [0] * (shape.rows - len(real_counts))


class _Inputs:
    """The static inputs of one shape's graph (outside the graph pool; a few hundred KB at most)."""

    def __init__(self, shape: PrefillShape, device: torch.device):
        self.tokens = torch.zeros(shape.tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(shape.tokens, dtype=torch.long, device=device)
        self.cu_seq = torch.zeros(shape.segments + 1, dtype=torch.int32, device=device)
        self.last = torch.zeros(shape.rows, dtype=torch.long, device=device)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.tokens, self.positions, self.cu_seq, self.last))


class PrefillGraphs:
    """Captured prefill passes of one ``Rollout`` (kept between calls with ``keep_cache``)."""

    def __init__(self, max_tokens: int, use_graphs: bool = True):
        self.max_tokens = max_tokens
        """``RolloutConfig.kernels.prefill_graph_tokens``: the most real tokens a captured pass takes."""
        self.use_graphs = use_graphs
        """False: run the padded pass eagerly (the CPU tests of its arithmetic)."""
        self.graphs = GraphSet("prefill")
        self.replays = 0
        """Passes run here (replayed, or captured then replayed)."""
        self.failure: Optional[str] = None
        """Why the passes went back to the eager prefill (None while they run here)."""
        self._inputs: dict[PrefillShape, _Inputs] = {}
        self._staging: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        """Keys and values ``[layers, tokens, Hkv, D]`` of the largest token bucket so far (shared by the graphs)."""
        self._logits: Optional[torch.Tensor] = None
        """``[rows, V]`` logits of the largest row bucket so far (shared by the graphs, copied out after each)."""

    def run(self, parts: StepParts, packed: "prefill.Packed", key_cache: torch.Tensor,
            value_cache: torch.Tensor) -> Optional[torch.Tensor]:
        """The pass of :func:`rollout.model.prefill.prefill_logits` over ``packed`` (keys/values written into
        ``key_cache``/``value_cache`` ``[layers, N, Hkv, capacity, D]``), returning the ``[N, V]`` logits; None
        where it does not run here (the caller then runs the eager pass)."""
        if self.failure is not None:
            return None
        device, dtype = key_cache.device, parts.weights.embed.dtype
        if self.use_graphs and device.type != "cuda":
            return None
        attend = prefill.varlen_attention(device, dtype)
        counts = packed.rows.real_counts
        shape = prefill_shape(counts, self.max_tokens)
        if attend is None or shape is None:
            return None
        try:
            return self._run(parts, packed, key_cache, value_cache, attend, shape)
        except Exception as exc:  # noqa: BLE001 - the eager pass still runs; say why once
            self._give_up(repr(exc))
            return None

    def _give_up(self, why: Optional[str]) -> None:
        self.failure = f"captured prefill failed ({why:.200}); the eager prefill runs instead"
        warnings.warn(self.failure, RuntimeWarning, stacklevel=3)
        self.clear()

    def _run(self, parts, packed, key_cache, value_cache, attend, shape: PrefillShape) -> torch.Tensor:
        counts = packed.rows.real_counts
        total, device = sum(counts), key_cache.device
        keys, values = self._staging_for(shape, key_cache)
        out = self._logits_for(shape, parts.weights.lm_head)[:shape.rows]
        bufs = self._inputs.get(shape)
        if bufs is None:
            bufs = self._inputs[shape] = _Inputs(shape, device)
        bufs.tokens[:total].copy_(packed.tokens)
        bufs.tokens[total:].zero_()
        bufs.positions[:total].copy_(packed.positions)
        bufs.positions[total:].zero_()
        bufs.cu_seq.copy_(to_device(padded_segments(counts, shape), device, torch.int32))
        bufs.last.copy_(to_device(padded_last(counts, shape), device))
        scale = parts.spec.head_dim ** -0.5

        def write_kv(layer: int, k, v):
            keys[layer, :shape.tokens].copy_(k[:, :, 0])
            values[layer, :shape.tokens].copy_(v[:, :, 0])

        def attend_layer(layer: int, q, k, v):
            out = attend(q[:, :, 0], k[:, :, 0], v[:, :, 0].contiguous(), bufs.cu_seq, shape.longest, scale)
            return out.unsqueeze(2)

        def work():
            out.copy_(prefill.packed_logits(parts, bufs.tokens, bufs.positions, bufs.last, write_kv, attend_layer))

        if self.use_graphs:
            path = self.graphs.replay((shape, parts.weights.signature(), keys.data_ptr()), work, [])
        else:
            path, _ = GRAPH, work()
        self.replays += 1
        for cache, staged in ((key_cache, keys), (value_cache, values)):  # [N, capacity, layers, Hkv, D] view
            cache.permute(1, 3, 0, 2, 4)[packed.row_of, packed.col_of] = staged[:, :total].transpose(0, 1)
        logits = out[:len(counts)].clone()
        if path != GRAPH:  # the capture failed: this pass ran padded and eagerly; later ones run unpadded
            self._give_up(self.graphs.fallback_reason)
        return logits

    def _staging_for(self, shape: PrefillShape, key_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys/values staging buffers, grown (and every graph dropped) when ``shape`` needs more tokens."""
        layers, _, kv_heads, _, dim = key_cache.shape
        held = self._staging
        if (held is None or held[0].shape[1] < shape.tokens or held[0].dtype != key_cache.dtype
                or held[0].device != key_cache.device or tuple(held[0].shape[2:]) != (kv_heads, dim)
                or held[0].shape[0] != layers):
            if held is not None:
                self._drop_graphs()
            self._staging = None  # freed before the larger one is allocated
            size = (layers, shape.tokens, kv_heads, dim)
            self._staging = held = tuple(torch.empty(size, dtype=key_cache.dtype, device=key_cache.device)
                                         for _ in range(2))
        return held

    def _logits_for(self, shape: PrefillShape, lm_head: torch.Tensor) -> torch.Tensor:
        """The shared logits buffer, grown (and every graph dropped) when ``shape`` has more rows."""
        held = self._logits
        if (held is None or held.shape[0] < shape.rows or held.shape[1] != lm_head.shape[0]
                or held.dtype != lm_head.dtype or held.device != lm_head.device):
            if held is not None:
                self._drop_graphs()
            self._logits = None
            self._logits = held = torch.empty(shape.rows, lm_head.shape[0], dtype=lm_head.dtype, device=lm_head.device)
        return held

    def new_bytes(self, model: torch.nn.Module) -> int:
        """Device bytes the staging buffers may still allocate (for the largest bucket, ``max_tokens`` rounded
        up; 0 where they are held at that size), from the model's config: what the memory budget counts before
        a call allocates them."""
        tokens = pow2_at_least(self.max_tokens, MIN_TOKENS)
        if self._staging is not None and self._staging[0].shape[1] >= tokens:
            return 0
        return tokens * cache_shape(model, 1, 1).column_bytes  # keys + values of every layer, a token each

    def _drop_graphs(self) -> None:
        """Drop the graphs and their inputs (a shared buffer they read or write is about to be replaced)."""
        self.graphs.clear()
        self._inputs.clear()

    def clear(self) -> None:
        """Drop every graph and buffer (``keep_cache=False``, ``shutdown``, a failure)."""
        self._drop_graphs()
        self._staging = None
        self._logits = None

    @property
    def nbytes(self) -> int:
        """Bytes held between calls: the staging and logits buffers and the graphs' inputs (graph pools not
        counted)."""
        held = [*(self._staging or ()), *(() if self._logits is None else (self._logits,))]
        return sum(t.numel() * t.element_size() for t in held) + sum(b.nbytes for b in self._inputs.values())

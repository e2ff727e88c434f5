"""Fast decode: our own step function (:mod:`rollout.fast_decode`) over static buffers, compiled and
captured in CUDA graphs per (batch bucket, length bucket), replayed every step.

- Static buffers (tokens, positions, cache column, step, validity mask, generated tokens, finished
  flags, repetition history) are allocated once per shape and reused across calls; the per-call
  decode state is made of views into them, so captured graphs stay valid.
- Batch buckets: the live batch is rounded up to the next bucket; padding rows compute garbage that
  is never read. Length buckets: attention reads only the first ``L`` cache columns, ``L`` the
  live length rounded up to ``LENGTH_BUCKET`` (not the whole capacity).
- A graph is captured once per key (bucket sizes, sampling settings, EOS ids, cache storage, weight
  addresses) and reused across rollout calls; a changed key (``sync_weights`` moving weights, a new
  cache) captures anew. Where graphs cannot be used the same step runs eagerly, and the reason is
  reported in the profile.
- The continuous route's step (:mod:`rollout.cb_graphs`) is captured the same way, per (batch bucket,
  read window), over its own static buffers (``cb_buffers_for`` / ``cb_stepper``).
"""

from __future__ import annotations

import functools

import torch

from rollout import fast_decode
from rollout.cb_graphs import CBBuffers, cb_decode_step, read_window
from rollout.sampling import select_next_token

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
LENGTH_BUCKET = 256


def sampling_key(sampling) -> tuple:
    """The sampling settings a captured step depends on (the seed lives in a buffer)."""
    if sampling.is_greedy:
        return ("greedy", sampling.repetition_penalty)
    return (sampling.temperature, sampling.top_k, sampling.top_p, sampling.repetition_penalty)


def batch_bucket(num_rows: int) -> int:
    for size in BATCH_BUCKETS:
        if num_rows <= size:
            return size
    return -(-num_rows // 128) * 128


def round_up(n: int, multiple: int = LENGTH_BUCKET) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (fewer distinct shapes, fewer re-allocations)."""
    return -(-n // multiple) * multiple


def length_bucket(live_len: int, capacity: int) -> int:
    return min(capacity, round_up(live_len))


@functools.lru_cache(maxsize=None)
def compiled_step_fns() -> fast_decode.StepFns:
    """``torch.compile``d pieces (inductor fuses norms, rotary, SiLU and residual adds; no inductor
    CUDA graphs: ours wrap the whole step). One compiled graph serves every layer."""
    compile_fn = functools.partial(torch.compile, dynamic=None, fullgraph=True)
    return fast_decode.StepFns(compile_fn(fast_decode.attention_inputs),
                               compile_fn(fast_decode.attention_output_and_mlp),
                               compile_fn(fast_decode.final_logits))


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
        self.rows = torch.arange(max_rows, **long)
        self.cols = torch.arange(capacity, **long)
        self.valid = torch.ones((max_rows, capacity), dtype=torch.bool, device=device)
        self.generated = torch.zeros((max_rows, max_new_tokens), **long)
        self.finished = torch.zeros(max_rows, dtype=torch.bool, device=device)
        self.seen = torch.zeros((max_rows, vocab_size), dtype=torch.bool, device=device)

    def fits(self, rows: int, capacity: int, max_new_tokens: int, vocab_size: int, device) -> bool:
        max_rows, cap, max_new, vocab, dev = self.shape
        return rows <= max_rows and capacity <= cap and max_new_tokens <= max_new and vocab == vocab_size \
            and dev == torch.device(device)

    def mutable(self) -> list[torch.Tensor]:
        return [self.tokens, self.positions, self.col, self.step, self.finished, self.seen]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in vars(self).values() if isinstance(t, torch.Tensor))


class FastDecoder:
    """Runs decode steps of one model through the fast step, with CUDA graphs where possible."""

    def __init__(self, model: torch.nn.Module, use_graphs: bool = True, use_compile: bool = True,
                 mirror_weights: bool = False):
        self.model = model
        self.use_graphs, self.use_compile = use_graphs, use_compile
        self.mirror = fast_decode.WeightMirror() if mirror_weights else None
        self.buffers: DecodeBuffers | None = None
        self._graphs: dict = {}  # the ordinary route's graphs
        self._pools: dict = {}  # route -> the private memory pool its graphs share
        self.num_captures = 0
        self.cb_buffers: CBBuffers | None = None  # the continuous route's (see rollout.cb_graphs)
        self._cb_graphs: dict = {}
        self.fallback_reason: str | None = None  # the last failed capture's (its steps then run eagerly)

    def buffers_for(self, rows: int, capacity: int, max_new_tokens: int, vocab_size: int, device) -> DecodeBuffers:
        bucket = batch_bucket(rows)
        if self.buffers is None or not self.buffers.fits(bucket, capacity, max_new_tokens, vocab_size, device):
            self._graphs.clear()
            self._pools.pop("ordinary", None)  # a private pool whose graphs are all gone cannot be reused
            self.buffers = None
            self.buffers = DecodeBuffers(bucket, round_up(capacity), round_up(max_new_tokens), vocab_size, device)
        return self.buffers

    def release(self) -> None:
        """Drop the static buffers and the captured graphs (``keep_cache=False``: nothing outlives a call)."""
        self._graphs.clear()
        self._pools.clear()
        self.buffers = None
        self._cb_graphs.clear()
        self.cb_buffers = None

    @property
    def nbytes(self) -> int:
        """Bytes held between calls: the static buffers and the weight mirror (graph pools not counted)."""
        held = sum(bufs.nbytes for bufs in (self.buffers, self.cb_buffers) if bufs is not None)
        return held + (self.mirror.nbytes if self.mirror is not None else 0)

    def step_parts(self, device: torch.device, mirrored: bool) -> tuple:
        """``(spec, weights, step fns)`` of this call: the model's current weights (``mirrored``: through
        the ZeRO-3 weight mirror, for captured steps, whose weights need fixed addresses) and the
        ``torch.compile``d pieces on CUDA when compiling is on, else the eager ones."""
        spec, weights = fast_decode.spec_and_weights(self.model)
        if mirrored and self.mirror is not None:  # ZeRO-3: gathered weights move at every gather; the mirror does not
            weights = self.mirror.refresh(weights)
        fns = compiled_step_fns() if (self.use_compile and device.type == "cuda") else fast_decode.StepFns()
        return spec, weights, fns

    def graph_reason(self, device: torch.device) -> str | None:
        """Why steps run eagerly (None: CUDA graphs)."""
        if not self.use_graphs:
            return "cuda_graphs disabled in RolloutConfig"
        if device.type != "cuda":
            return f"device {device.type} has no CUDA graphs"
        return None

    def stepper(self, cache, num_rows: int, sampling, eos_ids: torch.Tensor | None, eos_key: tuple,
                has_seen: bool):
        """A function ``step(live_len) -> "graph" | "eager"`` running one decode step for rows
        ``[0, num_rows)`` (everything looked up once per call, nothing per step but the graph key)."""
        bufs = self.buffers
        bucket = batch_bucket(num_rows)
        device = bufs.tokens.device
        spec, weights, fns = self.step_parts(device, mirrored=True)
        self.last_weight_signature = signature = weights.signature()
        use_graphs = self.graph_reason(device) is None
        static_key = (bucket, sampling_key(sampling), eos_key, has_seen, cache.key_storage.data_ptr(),
                      tuple(cache.key_storage.shape), signature) if use_graphs else None

        def step(live_len: int) -> str:
            length = length_bucket(live_len, cache.shape.capacity)

            def work():
                _decode_step(spec, weights, fns, cache, bufs, bucket, length, sampling, eos_ids, has_seen)

            if not use_graphs:
                work()
                return "eager"
            return self._replay(self._graphs, (length, static_key), work, bufs.mutable(), "ordinary")

        return step

    def _replay(self, graphs: dict, key, work, mutable: list[torch.Tensor], route: str) -> str:
        """Replay the graph captured for ``key`` (capturing it on first use) and return ``"graph"``; where
        the capture fails, run ``work`` eagerly now and for every later step of that key, record the
        reason in ``fallback_reason`` and return ``"eager"``."""
        graph = graphs.get(key)
        if graph is None:
            if route not in self._pools:
                self._pools[route] = torch.cuda.graph_pool_handle()
            try:
                graph = capture_graph(work, mutable, self._pools[route])
            except Exception as exc:  # noqa: BLE001 - the step still runs, eagerly, and the profile says why
                self.fallback_reason = f"{route} route: CUDA graph capture failed ({exc!r:.200})"
                graph = False
            else:
                self.num_captures += 1
            graphs[key] = graph
        if graph is False:
            work()
            return "eager"
        graph.replay()
        return "graph"

    # ---- the continuous route ----------------------------------------------------------------------
    def cb_buffers_for(self, slots: int, capacity: int, rows: int, max_new_tokens: int, vocab_size: int, device,
                       with_seen: bool) -> CBBuffers:
        """The continuous route's static buffers for ``slots`` (a batch bucket) x ``capacity``; reused
        while they fit (the graphs captured over them too), reallocated (graphs dropped) otherwise."""
        if self.cb_buffers is None or not self.cb_buffers.fits(slots, capacity, rows, max_new_tokens, vocab_size,
                                                               device, with_seen):
            self._cb_graphs.clear()
            self._pools.pop("continuous", None)
            self.cb_buffers = None
            self.cb_buffers = CBBuffers(slots, capacity, rows, round_up(max_new_tokens), vocab_size, device,
                                        with_seen)
        return self.cb_buffers

    def cb_stepper(self, cache, sampling, has_seen: bool):
        """``step(num_rows, front, read_start) -> "graph" | "eager"``: one continuous decode step of live
        rows ``[0, num_rows)`` writing column ``front`` and reading from ``read_start`` on
        (``cache.begin_decode`` already ran and the rows' data is in ``cb_buffers.rowdata``)."""
        bufs = self.cb_buffers
        device = bufs.rowdata.device
        spec, weights, fns = self.step_parts(device, mirrored=True)
        use_graphs = self.graph_reason(device) is None
        static_key = (sampling_key(sampling), has_seen, cache.key_storage.data_ptr(), tuple(cache.key_storage.shape),
                      cache.valid.data_ptr(), weights.signature()) if use_graphs else None

        def step(num_rows: int, front: int, read_start: int) -> str:
            bucket = batch_bucket(num_rows)
            window = read_window(read_start, front, cache.capacity, LENGTH_BUCKET)

            def work():
                cb_decode_step(spec, weights, fns, cache, bufs, bucket, window, sampling, has_seen)

            if not use_graphs:
                work()
                return "eager"
            return self._replay(self._cb_graphs, (bucket, window, static_key), work, bufs.mutable(), "continuous")

        return step


_WARMUP_STREAMS: dict[int, "torch.cuda.Stream"] = {}


def _warmup_stream(device_index: int) -> "torch.cuda.Stream":
    """One side stream per device for every warm-up. The GEMM libraries keep a workspace per stream
    they ran on for the life of the process; with a new stream per capture, each capture left ~66 MiB
    allocated for good (measured on the H200: +66 MiB per ``keep_cache=False`` call)."""
    if device_index not in _WARMUP_STREAMS:
        _WARMUP_STREAMS[device_index] = torch.cuda.Stream(device_index)
    return _WARMUP_STREAMS[device_index]


def capture_graph(step, mutable: list[torch.Tensor], pool) -> "torch.cuda.CUDAGraph":
    """Warm up (compiling on first use) and capture ``step`` in ``pool``. The ``mutable`` tensors it
    writes are restored after every warm-up run, so the captured step starts from the live state; the
    cache column a warm-up writes is rewritten by the real step before anything reads it."""
    saved = [t.clone() for t in mutable]
    stream = _warmup_stream(torch.cuda.current_device())
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            try:
                step()
            finally:  # restored after every run, also when one fails (the caller then runs it eagerly)
                for dst, src in zip(mutable, saved):
                    dst.copy_(src)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        step()
    return graph


def _decode_step(spec, weights, fns, cache, bufs: DecodeBuffers, bucket: int, length: int, sampling, eos_ids,
                 has_seen: bool) -> None:
    """The captured work: logits, token choice, and every buffer update (no host sync)."""
    keep = (bufs.valid[:bucket, :length] & (bufs.cols[:length] <= bufs.col))[:, None, None, :]
    key_cache = cache.key_storage[:, :bucket]
    value_cache = cache.value_storage[:, :bucket]
    logits = fast_decode.decode_logits(spec, weights, fns, key_cache, value_cache, bufs.tokens[:bucket],
                                       bufs.positions[:bucket], bufs.col, keep)
    seen = bufs.seen[:bucket] if has_seen else None
    tokens = select_next_token(logits, sampling, seen, bufs.seed, bufs.rows[:bucket], bufs.step)
    bufs.generated[:bucket].index_copy_(1, bufs.step.view(1), tokens[:, None])
    bufs.tokens[:bucket].copy_(tokens)
    bufs.positions[:bucket].add_(1)
    bufs.col.add_(1)
    bufs.step.add_(1)
    if eos_ids is not None:
        bufs.finished[:bucket] |= torch.isin(tokens, eos_ids)
    if has_seen:
        bufs.seen[:bucket].scatter_(1, tokens[:, None], True)
